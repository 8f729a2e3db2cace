"""The ClientApp Flower loads (`clients.worker:app`), and the warm per-node worker it hands
messages to in deployment.

A deployed SuperNode runs each message in a fresh `flwr-clientapp` process, which would import
torch and rebuild the client (model, data shard, vision features, private state) every time:
about ten seconds a message on the tiny profile, two messages per USL step. So in that process
this app only relays: it passes the message and its context to a worker that this run keeps on
this node, which runs the handlers of `clients.app` with everything resident and returns the
reply and the context's state. The relay imports nothing but flwr. Elsewhere (Flower's
simulation, whose Ray actors are warm already) the handlers run in place.

One worker serves one run on one SuperNode process: messages of other runs, or of the node
restarted, get workers of their own (and client state is per run on disk, clients.runtime).
It listens on a Unix socket in a folder only this user can enter, serves one message at a time,
and leaves, snapshotting any progress held only in memory, after `clients.worker_idle_s`
without a message or as soon as its SuperNode is gone. Messages cross the socket in Flower's
own formats (the message's inflatable objects, the context's protobuf), never as pickles.
`clients.warm_worker = false` runs every message in its own process instead.
"""

import fcntl
import json
import os
import select
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from hashlib import sha256
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.serde import context_from_proto, context_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.task_identity import TaskIdentity

from clients import ONE_MESSAGE_PER_PROCESS

WARM_WORKER = "clients.warm_worker"
IDLE = "clients.worker_idle_s"
TIMEOUT = "faults.timeout_s"
# Longest wait for a new worker to listen: its imports (it builds the client at its first message).
START_TIMEOUT_S = 300.0
_LENGTH = struct.Struct("!Q")


class WorkerFailure(RuntimeError):
    """A message failed in the warm worker (the handler raised, or the worker died)."""


class Relay(ClientApp):
    """Every message type goes to `clients.app`'s handlers: through a warm worker where this
    process serves one message, in place otherwise."""

    def __call__(self, message: Message, context: Context) -> Message:
        if ONE_MESSAGE_PER_PROCESS and _setting(context, WARM_WORKER):
            return relay(message, context, WorkerAddress.of(context))
        return handlers()(message, context)


app = Relay()


def handlers() -> ClientApp:
    # Imported on first use: it brings torch and the model code, which the relay never needs.
    from clients.app import app as client_app

    return client_app


def _setting(context: Context, key: str):
    if key not in context.run_config:
        raise KeyError(f"the run config has no {key}; every app declares every key of config.schema")
    return context.run_config[key]


def worker_folder() -> Path:
    """The folder of this user's workers: created private, refused if anyone else could enter it."""
    folder = Path(tempfile.gettempdir()) / f"qpriv-workers-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{folder} must be a folder of user {os.getuid()} that only it can enter (chmod 700)")
    return folder


class WorkerAddress:
    """Where the worker of (run, node, SuperNode process) listens, logs and is started under
    lock, and the SuperNode process whose end ends it."""

    def __init__(self, name: str, supernode_pid: int) -> None:
        # Short names: a Unix socket path must stay under 108 bytes.
        folder = worker_folder()
        self.socket, self.lock, self.log = (folder / f"{name}{suffix}" for suffix in (".sock", ".lock", ".log"))
        self.supernode_pid = supernode_pid

    @classmethod
    def of(cls, context: Context) -> "WorkerAddress":
        # The parent is the SuperNode's process that starts ClientApps; a restarted node has a new one.
        supernode_pid = os.getppid()
        key = f"{context.run_id}:{context.node_id}:{supernode_pid}"
        return cls(sha256(key.encode()).hexdigest()[:20], supernode_pid)


def relay(message: Message, context: Context, address: WorkerAddress) -> Message:
    """`message` answered by the warm worker at `address` (started if none listens); the
    worker's context state becomes `context`'s, as if the handler had run here."""
    header, blobs = pack_message(message)
    header["task"] = [TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id]
    context_bytes = context_to_proto(context).SerializeToString()
    timeout = float(_setting(context, TIMEOUT))
    with connect(address, float(_setting(context, IDLE))) as channel:
        # The server waits no longer for the reply; neither does this process for the worker.
        channel.settimeout(timeout)
        try:
            send(channel, header, [*blobs, context_bytes])
            answer, blobs = receive(channel)
        except TimeoutError:
            raise WorkerFailure(f"no reply from the warm worker within {TIMEOUT}={timeout}s; its log: {address.log}") from None
        except ConnectionError as error:
            raise WorkerFailure(f"the warm worker ended before it replied ({error}); its log: {address.log}") from None
    if "error" in answer:
        raise WorkerFailure(f"{answer['error']} (in the warm worker; its log: {address.log})")
    context.state = context_from_proto(ProtoContext.FromString(blobs[-1])).state
    return unpack_message(answer, blobs[:-1])


def connect(address: WorkerAddress, idle_s: float) -> socket.socket:
    """A connection to the worker at `address`, starting it if none listens. Under the address's
    lock, so one worker starts, and none leaves between this connect and its accept."""
    with open(address.lock, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        channel = _try_connect(address)
        if channel is not None:
            return channel
        address.socket.unlink(missing_ok=True)  # a worker killed without cleaning up
        with open(address.log, "a") as log:
            worker = subprocess.Popen(
                [sys.executable, "-m", "clients.worker", str(address.socket), str(address.lock), str(address.supernode_pid),
                 str(idle_s)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if worker.poll() is not None:
                raise WorkerFailure(f"the warm worker exited {worker.returncode} before it listened; its log: {address.log}")
            channel = _try_connect(address)
            if channel is not None:
                return channel
            time.sleep(0.05)
        worker.kill()
        raise WorkerFailure(f"the warm worker did not listen within {START_TIMEOUT_S:.0f}s; its log: {address.log}")


def _try_connect(address: WorkerAddress) -> socket.socket | None:
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        channel.connect(str(address.socket))
    except (FileNotFoundError, ConnectionRefusedError):
        channel.close()
        return None
    return channel


def send(channel: socket.socket, header: dict, blobs: list[bytes]) -> None:
    """One frame: the JSON header (with every blob's length), then the blobs."""
    head = json.dumps({**header, "blob_sizes": [len(blob) for blob in blobs]}).encode()
    channel.sendall(_LENGTH.pack(len(head)) + head)
    for blob in blobs:
        channel.sendall(blob)


def receive(channel: socket.socket) -> tuple[dict, list[bytes]]:
    header = json.loads(_exactly(channel, _LENGTH.unpack(_exactly(channel, _LENGTH.size))[0]))
    return header, [_exactly(channel, length) for length in header.pop("blob_sizes")]


def _exactly(channel: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = channel.recv(min(left, 1 << 22))
        if not chunk:
            raise ConnectionError(f"the peer closed the socket with {left} of {size} bytes unread")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def pack_message(message: Message) -> tuple[dict, list[bytes]]:
    """A message as its inflatable objects (Flower's wire format), root first."""
    objects = get_all_nested_objects(message)
    root = message.object_id
    ids = [root, *(object_id for object_id in objects if object_id != root)]
    return {"objects": ids, "message_id": message.metadata.message_id}, [objects[object_id].deflate() for object_id in ids]


def unpack_message(header: dict, blobs: list[bytes]) -> Message:
    ids = header["objects"]
    message = inflate_object_from_contents(ids[0], dict(zip(ids, blobs)))
    # The id is the object's own hash, which the deflated form does not hold (as run_clientapp sets it).
    message.metadata.__dict__["_message_id"] = header["message_id"]
    return message


def serve(socket_path: Path, lock_path: Path, supernode_pid: int, idle_s: float,
          client_app: Callable[[Message, Context], Message]) -> None:
    """Answer relayed messages one at a time until `idle_s` pass without one or the SuperNode is gone."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path))
    listener.listen(8)

    def leave() -> None:
        listener.close()
        socket_path.unlink(missing_ok=True)

    last = time.monotonic()
    try:
        while True:
            if select.select([listener], [], [], 1.0)[0]:
                channel, _ = listener.accept()
                with channel:
                    try:
                        _answer(channel, client_app)
                    except OSError as error:  # the relay went away (its node stopped it): serve the next
                        print(f"a relay left mid-message: {error}", flush=True)
                last = time.monotonic()
            elif not _alive(supernode_pid):
                # No relay looks for this address any more (it names the SuperNode's process).
                return leave()
            elif time.monotonic() - last > idle_s:
                with open(lock_path, "a") as lock:
                    # A relay holds the lock from its connect until it is accepted: none waits now,
                    # and the next one finds no socket and starts a new worker.
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    if not select.select([listener], [], [], 0)[0]:
                        return leave()
    finally:
        listener.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _answer(channel: socket.socket, client_app: Callable[[Message, Context], Message]) -> None:
    header, blobs = receive(channel)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = header.pop("task")
    try:
        message = unpack_message(header, blobs[:-1])
        context = context_from_proto(ProtoContext.FromString(blobs[-1]))
        reply = client_app(message, context)
    except Exception as error:  # noqa: BLE001 — the relay raises it as the ClientApp's error
        traceback.print_exc()
        sys.stdout.flush()
        send(channel, {"error": f"{type(error).__name__}: {error}"}, [])
        return
    answer, reply_blobs = pack_message(reply)
    send(channel, answer, [*reply_blobs, context_to_proto(context).SerializeToString()])


def main(argv: list[str]) -> None:
    socket_path, lock_path, supernode_pid, idle_s = Path(argv[0]), Path(argv[1]), int(argv[2]), float(argv[3])
    # Here, in the worker, the client code is wanted; the relay's process must never import it.
    from clients.runtime import snapshot_unsaved_progress

    try:
        serve(socket_path, lock_path, supernode_pid, idle_s, handlers())
    finally:
        snapshot_unsaved_progress()


if __name__ == "__main__":
    main(sys.argv[1:])

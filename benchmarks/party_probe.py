"""Per-party timings and memory of a USL run, taken inside the run's own processes.

benchmarks/gpu_scale.py runs sims/usl_vqarad through `flwr run` from an app folder holding the
sim's pyproject.toml with its components pointed here (`gpu_scale.probed_app`), and this module
beside it: `server_app` and `client_app` are the sim's own ServerApp and ClientApp with probes
installed in their process. A probe times the party's own methods in place, so the run is the
sim's code. What each record's `name` times:

    server  build               strategies.app.load_party_model: the body's model, LoRA and all
            step                USLStrategy.step: one client step, end to end
            body                USLStrategy.body: the body's forward
            first_cut_gradient  USLStrategy.first_cut_gradient: the body's backward and AdamW step
            wait                strategies.base.send_and_await: a message out until its reply is in
    client  message             the whole handler of one message (clients.worker's ClientApp)
            runtime             clients.runtime.build_runtime: model, data, vision features, DTP inputs
            build               clients.runtime.load_party_model: head and tail, LoRA and all
            cut_activation      SplitClient.cut_activation: the head's forward, DTP included
            front_backward      SplitClient.front_backward: the head's backward and AdamW step, then
                                the next step's cut_activation
            tail_step           USLClient.tail_step: the tail's forward, loss, backward and AdamW step
            tail                USLClient._tail: the tail's forward with the LM head
            snapshot            ClientRuntime.save_private_state: adapters and AdamW to disk, once a turn

Each timed call appends one JSON line to <run folder>/probes/<role>-<pid>.jsonl:

    name, parent          what was timed, and the timed call it ran inside (None at the top)
    round, partition, message, node   from what it serves, inherited by the calls inside it
    start, seconds        when it began (time.time(), comparable across processes) and how long it took
    children_s            the time of the timed calls inside it (its own time is seconds - children_s)
    peak_bytes, held_bytes, memory    the process's memory when it ended: "cuda" (torch's
                          allocator; its peak is reset after the model is built, so a later peak
                          is the steps'), or "rss" on the CPU (the process's peak resident set)

A timed call starts and ends with torch.cuda.synchronize(), so the GPU work a call queues counts
in the call. Flower imports this file from the app folder, where benchmarks/ is on no path: it
imports only the project's packages.
"""

import functools
import json
import os
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from clients.worker import app as sim_client_app
from config import SimConfig, load_config
from training import protocol

SERVER, CLIENT = "server", "client"
PROBE_FOLDER = "probes"


def probe_folder(config: SimConfig) -> Path:
    return config.run_folder() / PROBE_FOLDER


def synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def memory() -> dict[str, Any]:
    """The process's peak and current memory: torch's CUDA allocator once CUDA is in use, else the RSS."""
    if torch.cuda.is_initialized():
        return {"peak_bytes": torch.cuda.max_memory_allocated(), "held_bytes": torch.cuda.memory_allocated(),
                "memory": "cuda"}
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return {"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "held_bytes": resident_pages * os.sysconf("SC_PAGE_SIZE"), "memory": "rss"}


class Probe:
    """One party's timed calls in this process, nested, written as they end."""

    def __init__(self, role: str, folder: Path) -> None:
        self.role = role
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{role}-{os.getpid()}.jsonl"
        self.open: list[dict[str, Any]] = []

    @contextmanager
    def span(self, name: str, *, reset_peak: bool = False, **context: Any) -> Iterator[None]:
        parent = self.open[-1] if self.open else None
        frame = {"name": name, "context": {**(parent["context"] if parent else {}), **context}, "children_s": 0.0}
        synchronize()
        start, began = time.time(), time.perf_counter()
        self.open.append(frame)
        try:
            yield
        finally:
            self.open.pop()
            synchronize()
            seconds = time.perf_counter() - began
            if parent is not None:
                parent["children_s"] += seconds
            record = {"role": self.role, "pid": os.getpid(), "name": name,
                      "parent": parent["name"] if parent else None, **frame["context"], "start": start,
                      "seconds": seconds, "children_s": frame["children_s"], **memory()}
            with self.path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
            if reset_peak and torch.cuda.is_initialized():
                torch.cuda.reset_peak_memory_stats()

    def timed(self, function: Callable, name: str, *, context: Callable[..., dict] | None = None,
              reset_peak: bool = False) -> Callable:
        """`function` timed as `name`; `context(*args, **kwargs)` names what the call serves."""

        @functools.wraps(function)
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            with self.span(name, reset_peak=reset_peak, **(context(*args, **kwargs) if context else {})):
                return function(*args, **kwargs)

        return timed_call


@dataclass
class Patch:
    """One attribute replaced: a module's function, or a method (possibly inherited) of a class."""

    owner: Any
    attribute: str
    replacement: Callable

    def apply(self) -> None:
        self.own = self.attribute in vars(self.owner)
        self.original = vars(self.owner).get(self.attribute)
        setattr(self.owner, self.attribute, self.replacement)

    def undo(self) -> None:
        if self.own:
            setattr(self.owner, self.attribute, self.original)
        else:
            delattr(self.owner, self.attribute)


@contextmanager
def installed(patches: Sequence[Patch]) -> Iterator[None]:
    for patch in patches:
        patch.apply()
    try:
        yield
    finally:
        for patch in reversed(patches):
            patch.undo()


# Each party imports only its own side's modules: a client's process never loads the server's.
def server_patches(probe: Probe) -> list[Patch]:
    from strategies import app, base
    from strategies.split import USLStrategy

    return [
        Patch(app, "load_party_model", probe.timed(app.load_party_model, "build", reset_peak=True)),
        Patch(USLStrategy, "step", probe.timed(USLStrategy.step, "step",
                                               context=lambda strategy, grid, node, round_, *rest, **kw: {
                                                   "round": round_, "node": node})),
        Patch(USLStrategy, "body", probe.timed(USLStrategy.body, "body")),
        Patch(USLStrategy, "first_cut_gradient", probe.timed(USLStrategy.first_cut_gradient, "first_cut_gradient")),
        Patch(base, "send_and_await", probe.timed(base.send_and_await, "wait",
                                                  context=lambda grid, message, *rest, **kw: {
                                                      "message": message.metadata.message_type})),
    ]


def client_patches(probe: Probe) -> list[Patch]:
    from clients import runtime
    from clients.split import SplitClient
    from clients.usl import USLClient

    return [
        Patch(runtime, "build_runtime", probe.timed(runtime.build_runtime, "runtime")),
        Patch(runtime, "load_party_model", probe.timed(runtime.load_party_model, "build", reset_peak=True)),
        Patch(SplitClient, "cut_activation", probe.timed(SplitClient.cut_activation, "cut_activation")),
        Patch(SplitClient, "front_backward", probe.timed(SplitClient.front_backward, "front_backward")),
        Patch(USLClient, "tail_step", probe.timed(USLClient.tail_step, "tail_step")),
        Patch(USLClient, "_tail", probe.timed(USLClient._tail, "tail")),
        Patch(runtime.ClientRuntime, "save_private_state",
              probe.timed(runtime.ClientRuntime.save_private_state, "snapshot")),
    ]


def message_context(message: Message, context: Context) -> dict[str, Any]:
    """What a client's message serves: its type, the node's partition, the round it names."""
    config = message.content.config_records.get(protocol.CONFIG) if message.has_content() else None
    return {"message": message.metadata.message_type,
            "partition": int(context.node_config.get(protocol.PARTITION_ID, 0)),
            "round": int(config["round"]) if config is not None and "round" in config else None}


class ProbedClientApp(ClientApp):
    """clients.worker's ClientApp, each message timed by `probe`. Without one, the client probe is
    made and installed at the first message and stays for the process's life (a Ray actor serves
    the run's messages); a caller that passes its probe installs its patches itself."""

    def __init__(self, inner: ClientApp, probe: Probe | None = None) -> None:
        super().__init__()
        self.inner, self.probe = inner, probe

    def __call__(self, message: Message, context: Context) -> Message:
        if self.probe is None:
            from clients.runtime import parsed_config

            self.probe = Probe(CLIENT, probe_folder(parsed_config(context.run_config)[0]))
            for patch in client_patches(self.probe):
                patch.apply()
        with self.probe.span("message", **message_context(message, context)):
            return self.inner(message, context)


client_app = ProbedClientApp(sim_client_app)
server_app = ServerApp()


@server_app.main()
def serve(grid: Grid, context: Context) -> None:
    """strategies.app's ServerApp, with the server probes installed while it runs."""
    from strategies.app import run

    config = load_config(context.run_config)
    with installed(server_patches(Probe(SERVER, probe_folder(config)))):
        run(grid, config)

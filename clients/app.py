"""The ClientApp of every paradigm: one handler per message type (training.protocol).

Handlers only translate messages: decode what arrived through the wire (which checks
names, shapes, dtypes and finiteness), call the paradigm's client logic, encode the
reply. An exception becomes Flower's error reply, whose reason the server reports.

Flower's default train message is FL's round of local training or, under paradigm mtv, a
client's task-vector share (clients.mtv): SecAgg+ runs on that message type only, and both reply
with one vector and its weight. FL's handlers take and return the adapters as fp32 numpy arrays;
`fl_wire_mod`, the outermost mod on them inside SecAgg+'s, decodes what arrived and encodes the
reply, so the mods inside it (Flower's DP mods, which `fl_dp_mod` applies as privacy.dp.mode
says) see the adapters as Flower's own mods expect them. Under SecAgg+ (privacy.secagg) Flower's `secaggplus_mod` is the
outermost (`fl_secagg_mod`): the adapters leave as its masked vector, not through the wire.
"""

import json
from collections.abc import Callable

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.client.mod import make_ffn, secaggplus_mod
from flwr.clientapp.mod import LocalDpMod, fixedclipping_mod
from flwr.common import Code, FitRes, Status
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat
from flwr.clientapp.typing import ClientAppCallable

from clients import mtv
from clients.local import evaluate_local, train_steps
from clients.runtime import ClientRuntime, client_runtime
from clients.sl import SLClient
from clients.split import SplitClient
from clients.usl import USLClient
from privacy.dp import CENTRAL_CLIENT_CLIPPING, LOCAL, local_dp_epsilon, seed_numpy
from training import protocol
from training.model import make_optimizer
from vlm.lora import load_owner_state_dict, owner_state_dict
from wire import Wire, numpy_record, numpy_tensors

app = ClientApp()

_SPLIT_CLIENTS = {"sl": SLClient, "usl": USLClient}


def _handles(message_type: str, mods: list | None = None) -> Callable:
    """The ClientApp decorator registering a handler for a protocol message type ("train.cl",
    or a bare "train" for Flower's default action), inside `mods` (outermost first)."""
    category, _, action = message_type.partition(".")
    return getattr(app, category)(*([action] if action else []), mods=mods)


def _reply(message: Message, wire: Wire, result: dict) -> Message:
    content = RecordDict(
        {protocol.TENSORS: wire.encode(result["tensors"]), protocol.METRICS: MetricRecord(result["metrics"])}
    )
    return Message(content=content, reply_to=message)


def _config(message: Message) -> ConfigRecord:
    return message.content.config_records[protocol.CONFIG]


def _received(message: Message, wire: Wire, rt: ClientRuntime) -> dict[str, torch.Tensor]:
    """The tensors the protocol says this message carries (protocol.CARRIES), checked by the wire."""
    kind = protocol.CARRIES[message.metadata.message_type]
    hidden = rt.model.get_base_model().config.text_config.hidden_size
    record = message.content.array_records[protocol.TENSORS]
    return wire.decode(record, kind.expectation(hidden=hidden), what=kind.name)


def _split_handler(body: Callable[[SplitClient, Message, Wire], dict]) -> Callable[[Message, Context], Message]:
    def handler(message: Message, context: Context) -> Message:
        rt = client_runtime(context)
        if rt.config.paradigm not in _SPLIT_CLIENTS:
            raise ValueError(f"{message.metadata.message_type} is a split-learning message; this run is {rt.config.paradigm!r}")
        wire = Wire(rt.config.wire.dtype)
        return _reply(message, wire, body(_SPLIT_CLIENTS[rt.config.paradigm](rt), message, wire))

    return handler


def _begin(client: SplitClient, message: Message, wire: Wire) -> dict:
    config = _config(message)
    return client.begin(int(config["round"]), int(config["committed-round"]))


def _front_backward(client: SplitClient, message: Message, wire: Wire) -> dict:
    config = _config(message)
    grad = _received(message, wire, client.rt)[protocol.GRAD]
    return client.front_backward(int(config["round"]), grad, bool(config["go-on"]))


def _usl_tail(client: USLClient, message: Message, wire: Wire) -> dict:
    return client.tail_step(int(_config(message)["round"]), _received(message, wire, client.rt)[protocol.ROWS])


def _eval_begin(client: SplitClient, message: Message, wire: Wire) -> dict:
    config = _config(message)
    result = client.eval_begin(int(config["round"]), int(config["batch"]))
    result["metrics"]["eval-batches"] = float(client.num_eval_batches())
    return result


def _usl_eval_tail(client: USLClient, message: Message, wire: Wire) -> dict:
    return client.eval_tail(_received(message, wire, client.rt)[protocol.ROWS])


def _sl_eval_next(client: SLClient, message: Message, wire: Wire) -> dict:
    return client.eval_advance(_received(message, wire, client.rt)[protocol.TOKENS].tolist())


for _name, _body in (
    (protocol.SPLIT_BEGIN, _begin),
    (protocol.SL_BACKWARD, _front_backward),
    (protocol.USL_HEAD, _front_backward),
    (protocol.USL_TAIL, _usl_tail),
    (protocol.EVAL_BEGIN, _eval_begin),
    (protocol.USL_EVAL_TAIL, _usl_eval_tail),
    (protocol.SL_EVAL_NEXT, _sl_eval_next),
):
    _handles(_name)(_split_handler(_body))


@_handles(protocol.PARTITION_QUERY)
def partition_query(message: Message, context: Context) -> Message:
    """The partition this node holds (its node_config), so the server orders clients by partition."""
    partition = int(context.node_config.get(protocol.PARTITION_ID, 0))
    metrics = MetricRecord({protocol.PARTITION_ID: partition})
    return Message(content=RecordDict({protocol.METRICS: metrics}), reply_to=message)


@_handles(protocol.CL_TRAIN)
def cl_train(message: Message, context: Context) -> Message:
    """CL: the one trainer runs a round's steps on all data; adapters and AdamW stay private."""
    rt = client_runtime(context)
    config = _config(message)
    rt.begin_turn(int(config["committed-round"]))
    metrics = train_steps(rt, rt.optimizers["all"], rt.config.train.steps_per_round, rt.config.train.grad_accum,
                          int(config["round"]))
    rt.save_private_state(int(config["round"]))
    return _reply(message, Wire(rt.config.wire.dtype), {"tensors": {}, "metrics": metrics})


@_handles(protocol.LOCAL_EVALUATE)
def local_evaluate(message: Message, context: Context) -> Message:
    rt = client_runtime(context)
    rt.sync_private_state()
    return _reply(message, Wire(rt.config.wire.dtype), {"tensors": {}, "metrics": evaluate_local(rt)})


def fl_wire_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """FL's wire on the client: the server's adapters decoded (checked against this model's own
    adapter set) to fp32 numpy for the mods and handler inside, their reply's encoded."""
    rt = client_runtime(context)
    wire = Wire(rt.config.wire.dtype)
    own = owner_state_dict(rt.model, rt.owned["all"], rt.adapter)
    kind = protocol.CARRIES[message.metadata.message_type]
    expected = kind.expectation(adapter_shapes={key: value.shape for key, value in own.items()})
    received = message.content.array_records[protocol.ARRAYS]
    arrays = wire.decode(received, expected, what=kind.name)
    # The decoded adapters stand in for the received bytes while the inner mods and handler run
    # (they reply to this very message); the message leaves as it arrived.
    message.content.array_records[protocol.ARRAYS] = numpy_record(arrays)
    try:
        reply = call_next(message, context)
    finally:
        message.content.array_records[protocol.ARRAYS] = received
    # Under SecAgg+ the adapters leave as fp32 for secaggplus_mod to quantise and mask.
    if not reply.has_error() and protocol.ARRAYS in reply.content.array_records and not rt.config.privacy.secagg.enabled:
        reply.content.array_records[protocol.ARRAYS] = wire.encode(numpy_tensors(reply.content.array_records[protocol.ARRAYS]))
    return reply


def fl_secagg_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's secaggplus_mod, when privacy.secagg is enabled: it answers the protocol's key
    stages itself and, in its masked-vector stage, runs the round's training (the mods inside)
    and masks the adapters it trained. That mod reads the legacy FitRes form, so the training
    reply is handed to it so; its own protocol record is taken off the message the inner mods see
    (Flower's DP mods expect the round's one config record)."""
    if not client_runtime(context).config.privacy.secagg.enabled:
        return call_next(message, context)

    def train(inner: Message, inner_context: Context) -> Message:
        protocol_record = inner.content.config_records.pop(RECORD_KEY_CONFIGS)
        try:
            reply = call_next(inner, inner_context)
        finally:
            inner.content.config_records[RECORD_KEY_CONFIGS] = protocol_record
        if reply.has_error():
            return reply
        metrics = reply.content.metric_records[protocol.METRICS]
        parameters = recorddict_compat.arrayrecord_to_parameters(reply.content.array_records[protocol.ARRAYS], keep_input=True)
        fitres = FitRes(Status(Code.OK, ""), parameters, int(metrics["num-examples"]),
                        {protocol.SECAGG_METRICS: json.dumps(dict(metrics))})
        return Message(recorddict_compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=inner)

    return secaggplus_mod(message, context, train)


def fl_dp_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """The client's part of DP-FedAvg (privacy.dp.mode), by Flower's own mods: client-side clipping
    clips the update to the norm the server's wrapper sent; local DP clips it to privacy.dp.clip
    and adds noise of std z · clip before it leaves, drawn from numpy's generator seeded by
    (privacy.seed, partition, round) so a rerun sends the same update."""
    rt = client_runtime(context)
    options = rt.config.privacy.dp
    if options.mode not in (CENTRAL_CLIENT_CLIPPING, LOCAL):
        return call_next(message, context)
    if options.mode == CENTRAL_CLIENT_CLIPPING:
        return fixedclipping_mod(message, context, call_next)
    partition = int(context.node_config.get(protocol.PARTITION_ID, 0))
    seed_numpy("local-dp", rt.config.privacy.seed, partition, int(_config(message)["round"]))
    local_dp = LocalDpMod(options.clip, options.clip, local_dp_epsilon(rt.local_dp_noise, options.delta), options.delta)
    return local_dp(message, context, call_next)


def _load_global(message: Message, rt: ClientRuntime) -> None:
    """FL: the server's adapters (fl_wire_mod decoded and checked them)."""
    segment = rt.owned["all"]
    dtype = next(iter(owner_state_dict(rt.model, segment, rt.adapter).values())).dtype
    arrays = numpy_tensors(message.content.array_records[protocol.ARRAYS])
    load_owner_state_dict(rt.model, segment, {key: value.to(dtype) for key, value in arrays.items()}, rt.adapter)


def fl_train(message: Message, context: Context) -> Message:
    """FL: T_l local steps from the global adapters with a fresh AdamW (no optimiser state is shared)."""
    rt = client_runtime(context)
    _load_global(message, rt)
    optimizer = make_optimizer(rt.parameters("all"), rt.config)
    # The batch order continues across rounds without any state surviving on the client.
    rt.step = (int(_config(message)["round"]) - 1) * rt.config.train.steps_per_round
    metrics = train_steps(rt, optimizer, rt.config.train.steps_per_round, 1, int(_config(message)["round"]))
    content = RecordDict(
        {
            protocol.ARRAYS: numpy_record(owner_state_dict(rt.model, rt.owned["all"], rt.adapter)),
            protocol.METRICS: MetricRecord(metrics),
        }
    )
    return Message(content=content, reply_to=message)


# FL's training handler inside its wire and DP mods (SecAgg+'s goes around `train`, below).
_FL_TRAIN = make_ffn(fl_train, [fl_wire_mod, fl_dp_mod])


def mtv_share(message: Message, context: Context) -> Message:
    """MTV: the sum of this client's clipped chunk activations, weighted by its chunk count. Under
    SecAgg+ it leaves as the mean (secaggplus_mod weights it by the count, so the unmasked weighted
    average is the sum over all chunks over m); otherwise as the sum, through the wire."""
    rt = client_runtime(context)
    total, chunks = mtv.share(rt)
    metrics = MetricRecord({"num-examples": float(chunks)})
    if rt.config.privacy.secagg.enabled:
        content = RecordDict({protocol.ARRAYS: numpy_record({protocol.SHARE: total / chunks}), protocol.METRICS: metrics})
        return Message(content=content, reply_to=message)
    return _reply(message, Wire(rt.config.wire.dtype), {"tensors": {protocol.SHARE: total}, "metrics": dict(metrics)})


@_handles(protocol.TRAIN, mods=[fl_secagg_mod])
def train(message: Message, context: Context) -> Message:
    """Flower's default train message: FL's local training, or MTV's share."""
    if not client_runtime(context).config.paradigm_spec.trains:
        return mtv_share(message, context)
    return _FL_TRAIN(message, context)


def _task_vector(message: Message, rt: ClientRuntime) -> dict[str, torch.Tensor]:
    kind = protocol.CARRIES[message.metadata.message_type]
    shape = mtv.layout(rt).shape
    expected = kind.expectation(layers=shape[0], heads=shape[1], head_dim=shape[2])
    return Wire(rt.config.wire.dtype).decode(message.content.array_records[protocol.TENSORS], expected, what=kind.name)


@_handles(protocol.MTV_SCORES)
def mtv_scores(message: Message, context: Context) -> Message:
    """MTV private selection: this client's counts over the candidate masks of the released values."""
    rt = client_runtime(context)
    scores = mtv.selection_scores(rt, _task_vector(message, rt)[protocol.VALUES])
    return _reply(message, Wire(rt.config.wire.dtype), {"tensors": {protocol.SCORES: scores}, "metrics": {}})


@_handles(protocol.MTV_EVALUATE)
def mtv_evaluate(message: Message, context: Context) -> Message:
    """MTV: the test share answered zero-shot and with the released task vector."""
    rt = client_runtime(context)
    vector = _task_vector(message, rt)
    metrics = mtv.evaluate(rt, vector[protocol.VALUES], vector[protocol.MASK])
    return _reply(message, Wire(rt.config.wire.dtype), {"tensors": {}, "metrics": metrics})


@_handles(protocol.FL_EVALUATE, mods=[fl_wire_mod])
def fl_evaluate(message: Message, context: Context) -> Message:
    rt = client_runtime(context)
    _load_global(message, rt)
    metrics = evaluate_local(rt)
    metrics["num-examples"] = metrics["count"]
    metrics["accuracy"] = metrics["correct"] / max(metrics["count"], 1.0)
    return Message(content=RecordDict({protocol.METRICS: MetricRecord(metrics)}), reply_to=message)

"""What both sides of a message agree on: message types, record keys, transfer kinds and their tensors.

Flower message types are `train`, `evaluate` or `query` with one `.identifier`
suffix; a ClientApp registers one handler per name below. A transfer kind names one
payload that crosses a party boundary, its direction and the tensors it holds; the
wire checks a received payload against `TransferKind.expectation`, the recorder files
transfers under the kind's name (so renaming a kind here renames it everywhere, and
recordings keep these exact strings on disk).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from wire.wire import DIRECTIONS, Expectation

# Record keys inside a message's RecordDict.
TENSORS = "wire"
CONFIG = "config"
METRICS = "metrics"
ARRAYS = "arrays"
# SecAgg+ (strategies.secagg): a training reply's metrics, as JSON under this key of the legacy
# FitRes metrics that Flower's protocol forwards (they take scalars only, the pruning record lists).
SECAGG_METRICS = "metrics-json"

# Split learning (SL and USL share the names; the handler set depends on the paradigm).
SPLIT_BEGIN = "train.split_begin"  # start a turn: client runs its front, replies with the cut activation
SL_BACKWARD = "train.sl_backward"  # gradient at the cut (+ next forward when the turn goes on)
USL_TAIL = "train.usl_tail"  # activation at CB -> client tail, loss, backward; replies the gradient at CB
USL_HEAD = "train.usl_head"  # gradient at CA (+ next forward when the turn goes on)
EVAL_BEGIN = "evaluate.split_begin"  # start scoring one batch of the client's test share
SL_EVAL_NEXT = "evaluate.sl_next"  # next tokens chosen by the server's LM head
USL_EVAL_TAIL = "evaluate.usl_tail"  # activation at CB; the client's tail picks the next tokens
CL_TRAIN = "train.cl"
LOCAL_EVALUATE = "evaluate.local"  # CL and FL: the client scores its test share on its own
# Flower's default message types, handled by `@app.train()` / `@app.evaluate()`: FL's FedAvg sends
# them; TRAIN is also MTV's share (SecAgg+ runs only on it).
TRAIN = "train"
FL_EVALUATE = "evaluate"
# Federated DP-MTV (paradigm mtv): after the shares, the released values for private head
# selection's scores, then the task vector each client answers its test share with.
MTV_SCORES = "train.mtv_scores"
MTV_EVALUATE = "evaluate.mtv"
# Start of every run (and resume): each node answers its partition, so clients are ordered by
# partition rather than by Flower's random node ids.
PARTITION_QUERY = "query.partition"
PARTITION_ID = "partition-id"  # the reply's metric, as the node's node_config names it
MESSAGE_TYPES = (
    SPLIT_BEGIN, SL_BACKWARD, USL_TAIL, USL_HEAD, EVAL_BEGIN, SL_EVAL_NEXT, USL_EVAL_TAIL, CL_TRAIN, LOCAL_EVALUATE,
    TRAIN, FL_EVALUATE, MTV_SCORES, MTV_EVALUATE, PARTITION_QUERY,
)
# An evaluation score's metrics, besides its summed score ("correct") and count: per question it
# scored, in the same order, its position in the run's test split (training.data.RunData.test_all,
# the order data.* load it in; positions, not VQASample.id: a MetricRecord holds numbers only, a
# position is exact where a hash of the id could collide, it is the smallest on the wire, whose bytes
# the run measures, and the server maps it back to the id from the same split) and its score
# (MTV: also the zero-shot one): what OUTCOMES_FILE records, to pair runs question by question.
QUESTIONS = "questions"
QUESTION_SCORES = "question-scores"
ZERO_SHOT_SCORES = "zero-shot-scores"
# The run folder's record of the answers: node id -> partition id of every node that served the run.
NODE_PARTITIONS_FILE = "nodes.json"
# The run folder's per-question outcomes of each evaluated round (strategies.callbacks.OutcomesLog).
OUTCOMES_FILE = "outcomes.jsonl"
# A sweep folder's record of its starts (sims.sweep writes it, analysis.runs reads each run's start
# from it), and the marker of a run folder restored from a sweep's archive (sims.archive).
SWEEP_STAMP = "sweep.json"
ARCHIVE_MARKER = "archived.json"
# MTV: the run folder's released task vector (values, mask, ledger), what a membership audit queries with.
TASK_VECTOR_FILE = "task_vector.pt"

# Tensor names.
ROWS = "rows"  # packed hidden states at a cut: the real tokens' rows [n, D]
LENGTHS = "lengths"  # each sample's real-token count [B]
GRAD = "grad"  # the gradient of the packed rows [n, D]
ANSWERS = "answers"  # SL: every sample's answer tokens, concatenated
ANSWER_LENGTHS = "answer_lengths"  # SL: each sample's answer length [B]
TOKENS = "tokens"  # SL evaluation: the next token per sample, chosen by the server's LM head [B]
SHARE = "share"  # MTV: a client's sum of clipped chunk activations [layers, heads, head_dim]
VALUES = "values"  # MTV: the released task vector [layers, heads, head_dim]
MASK = "mask"  # MTV: the heads it replaces [layers, heads], 0 or 1
SCORES = "scores"  # MTV private selection: per candidate mask, the client's chunks it helps [candidates]

# Named sizes a tensor's shape may refer to (`TransferKind.expectation` fills them in).
HIDDEN = "hidden"  # the decoder's hidden size D
ROW_COUNT = "rows"  # the number of rows the receiver expects back (one per row it sent)
LAYERS, HEADS, HEAD_DIM = "layers", "heads", "head_dim"  # MTV: a task vector's layout


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a payload: its shape (an int, None for any size, or a named size) and
    "float" (travels in the wire dtype) or "index" (travels as int32)."""

    name: str
    shape: tuple[int | str | None, ...]
    dtype: str


@dataclass(frozen=True)
class TransferKind:
    """A payload that crosses a party boundary: "up" client -> server, "down" server -> client.

    `adapters`: the tensors are the receiver's LoRA adapter set (names and shapes depend
    on the model, so the caller gives them). `replayed`: a payload the server sends that
    attacks replay, so the wire shows it to observers of what is sent.
    """

    name: str
    direction: str
    tensors: tuple[TensorSpec, ...] = ()
    adapters: bool = False
    replayed: bool = False

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(f"{self.name}: direction={self.direction!r}; allowed: {DIRECTIONS}")

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(spec.name for spec in self.tensors)

    def expectation(
        self, *, adapter_shapes: Mapping[str, Sequence[int]] | None = None, **sizes: int
    ) -> dict[str, Expectation]:
        """What `Wire.decode` / `Wire.received` check this payload against; `sizes` fill the
        named sizes of the shapes (e.g. hidden=D)."""
        if self.adapters:
            if adapter_shapes is None:
                raise ValueError(f"{self.name} carries the adapter set: pass adapter_shapes")
            return {name: (tuple(shape), "float") for name, shape in adapter_shapes.items()}
        expected = {}
        for spec in self.tensors:
            missing = [dim for dim in spec.shape if isinstance(dim, str) and dim not in sizes]
            if missing:
                raise ValueError(f"{self.name}: tensor {spec.name!r} needs the size(s) {missing}")
            shape = tuple(sizes[dim] if isinstance(dim, str) else dim for dim in spec.shape)
            expected[spec.name] = (shape, spec.dtype)
        return expected


_PACKED = (TensorSpec(ROWS, (None, HIDDEN), "float"), TensorSpec(LENGTHS, (None,), "index"))
_ANSWERS = (TensorSpec(ANSWERS, (None,), "index"), TensorSpec(ANSWER_LENGTHS, (None,), "index"))

# Client -> server.
ACTIVATION_AT_CA = TransferKind("activation at CA", "up", _PACKED)  # USL training, first cut
ACTIVATION_AT_C = TransferKind("activation at C", "up", _PACKED + _ANSWERS)  # SL training: labels ride along
EVAL_ACTIVATION_AT_CA = TransferKind("evaluation activation at CA", "up", _PACKED)
EVAL_ACTIVATION_AT_C = TransferKind("evaluation activation at C", "up", _PACKED)
GRADIENT_AT_CB = TransferKind("gradient at CB", "up", (TensorSpec(GRAD, (ROW_COUNT, HIDDEN), "float"),))
ADAPTER_UPDATE = TransferKind("adapter update", "up", adapters=True)  # FL
_TASK_VECTOR = TensorSpec(VALUES, (LAYERS, HEADS, HEAD_DIM), "float")
TASK_VECTOR_SHARE = TransferKind("task vector share", "up", (TensorSpec(SHARE, (LAYERS, HEADS, HEAD_DIM), "float"),))
SELECTION_SCORES = TransferKind("selection scores", "up", (TensorSpec(SCORES, (None,), "index"),))
# Metrics-only replies: counted on the ledger, no tensors.
END_OF_TURN = TransferKind("end of turn", "up")
EVALUATION_SCORE = TransferKind("evaluation score", "up")
TRAINING_REPORT = TransferKind("training report", "up")  # CL

# Server -> client.
ACTIVATION_AT_CB = TransferKind("activation at CB", "down", (TensorSpec(ROWS, (None, HIDDEN), "float"),), replayed=True)
EVAL_ACTIVATION_AT_CB = TransferKind("evaluation activation at CB", "down", (TensorSpec(ROWS, (None, HIDDEN), "float"),))
GRADIENT_AT_CA = TransferKind("gradient at CA", "down", (TensorSpec(GRAD, (None, HIDDEN), "float"),))
GRADIENT_AT_C = TransferKind("gradient at C", "down", (TensorSpec(GRAD, (None, HIDDEN), "float"),))
NEXT_TOKENS = TransferKind("next tokens", "down", (TensorSpec(TOKENS, (None,), "index"),))
GLOBAL_ADAPTERS = TransferKind("global adapters", "down", adapters=True, replayed=True)  # FL training
EVALUATION_ADAPTERS = TransferKind("evaluation adapters", "down", adapters=True)  # FL evaluation
RELEASED_VALUES = TransferKind("released task vector values", "down", (_TASK_VECTOR,))  # MTV private selection
TASK_VECTOR = TransferKind("task vector", "down", (_TASK_VECTOR, TensorSpec(MASK, (LAYERS, HEADS), "index")))

KINDS: dict[str, TransferKind] = {
    kind.name: kind
    for kind in (
        ACTIVATION_AT_CA, ACTIVATION_AT_C, EVAL_ACTIVATION_AT_CA, EVAL_ACTIVATION_AT_C, GRADIENT_AT_CB,
        ADAPTER_UPDATE, END_OF_TURN, EVALUATION_SCORE, TRAINING_REPORT, ACTIVATION_AT_CB,
        EVAL_ACTIVATION_AT_CB, GRADIENT_AT_CA, GRADIENT_AT_C, NEXT_TOKENS, GLOBAL_ADAPTERS, EVALUATION_ADAPTERS,
        TASK_VECTOR_SHARE, SELECTION_SCORES, RELEASED_VALUES, TASK_VECTOR,
    )
}

# The payload each server message carries to the client (messages absent here carry only config).
CARRIES: dict[str, TransferKind] = {
    SL_BACKWARD: GRADIENT_AT_C,
    USL_HEAD: GRADIENT_AT_CA,
    USL_TAIL: ACTIVATION_AT_CB,
    USL_EVAL_TAIL: EVAL_ACTIVATION_AT_CB,
    SL_EVAL_NEXT: NEXT_TOKENS,
    TRAIN: GLOBAL_ADAPTERS,  # FL's; MTV's share carries only config
    FL_EVALUATE: EVALUATION_ADAPTERS,
    MTV_SCORES: RELEASED_VALUES,
    MTV_EVALUATE: TASK_VECTOR,
}

# The activation at the first cut, per split paradigm (what the activation attacks read).
FIRST_CUT_ACTIVATION: dict[str, TransferKind] = {"usl": ACTIVATION_AT_CA, "sl": ACTIVATION_AT_C}
EVAL_FIRST_CUT_ACTIVATION: dict[str, TransferKind] = {"usl": EVAL_ACTIVATION_AT_CA, "sl": EVAL_ACTIVATION_AT_C}


def kind(name: str) -> TransferKind:
    """The kind called `name`; a ValueError naming the known kinds otherwise."""
    if name not in KINDS:
        raise ValueError(f"transfer kind {name!r} is not in the protocol (training.protocol); known: {sorted(KINDS)}")
    return KINDS[name]

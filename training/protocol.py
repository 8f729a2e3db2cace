"""Names both sides of a message agree on: message types and record keys.

Flower message types are `train`, `evaluate` or `query` with one `.identifier`
suffix; a ClientApp registers one handler per name below.
"""

# Record keys inside a message's RecordDict.
TENSORS = "wire"
CONFIG = "config"
METRICS = "metrics"
ARRAYS = "arrays"

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

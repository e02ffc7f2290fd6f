"""The planner: which layouts of a config fit N devices, with each one's predicted memory and step time
(`raypar plan`, and `raypar train`'s checks that a model fits). What callers use is here; the parts are
the search (`search`), memory per actor (`memory`), step time (`step`, with the bytes of `comm`) and the
order `raypar plan` prints them in (`rank`).
"""

from raypar.core.planner import rank
from raypar.core.planner.memory import Layout, predict_memory, rank_chunks, rank_states
from raypar.core.planner.search import (
    candidates,
    check_fits,
    check_local_memory,
    current_layout,
    device_named,
    fitting_knob,
    gib,
    knobs,
    layout_config,
    parse_size,
    plan,
)
from raypar.core.planner.step import DEVICES, Device, Prediction, bubble_ratio, predict

__all__ = [
    "DEVICES", "Device", "Layout", "Prediction", "bubble_ratio", "candidates", "check_fits",
    "check_local_memory", "current_layout", "device_named", "fitting_knob", "gib", "knobs", "layout_config",
    "parse_size", "plan", "predict", "predict_memory", "rank", "rank_chunks", "rank_states",
]

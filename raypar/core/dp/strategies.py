"""The data-parallel strategies by name: `parallel.zero` (the stage number users write) -> the class.

What the driver and the actors need to know of a strategy (is its state sharded, can a lost replica be
rebuilt from peers, does it all-reduce) is its class's `stage` (`raypar.core.config.options.ZeroStage`),
asked through `STRATEGIES[zero].stage`, never by comparing stage numbers. The keys are the levels of
`raypar.core.config.options.ZERO_STAGES`, which the config rules read (tests/test_config.py checks that
they agree).
"""

from __future__ import annotations

from raypar.core.dp.strategy import DPStrategy, Zero1, Zero2
from raypar.core.dp.zero3 import Zero3Strategy

STRATEGIES: dict[int, type[DPStrategy]] = {
    cls.stage.level: cls for cls in (DPStrategy, Zero1, Zero2, Zero3Strategy)
}

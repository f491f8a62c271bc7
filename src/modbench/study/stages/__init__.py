"""A study as stages (:mod:`modbench.study.stages.base`): the study's own runs
(:mod:`~modbench.study.stages.frozen`), the group-sequential looks of ``--until-decided``
(:mod:`~modbench.study.stages.sequential`), a ``tuning`` block's tuning and tuned stages
(:mod:`~modbench.study.stages.tuning`) and an ``lr_profile`` block's learning-rate profile
(:mod:`~modbench.study.stages.profile`), and the replications of ``modbench study replicate``
(:mod:`~modbench.study.stages.replication`), in the order they run. The runner, the dry run,
``study status`` and the report ask :func:`stages_for`; a new kind of stage is one module here
with ``register(MyStage)`` at its end, and one import line below.
"""

from modbench.study.stages import frozen, profile, replication, sequential, tuning
from modbench.study.stages.base import (
    RunSettings,
    Session,
    Stage,
    StatusPart,
    kinds,
    register,
    stages_for,
)

__all__ = ["RunSettings", "Session", "Stage", "StatusPart", "frozen", "kinds", "profile",
           "register", "replication", "sequential", "stages_for", "tuning"]

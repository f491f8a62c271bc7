"""Judging results: the verdict rule and its statistics (:mod:`~modbench.analysis.stats`),
results tables (:mod:`~modbench.analysis.results`), scaling fits
(:mod:`~modbench.analysis.scaling`), power and seed planning (:mod:`~modbench.analysis.power`)
and loss-curve shape (:mod:`~modbench.analysis.trajectory`).

Measuring models and machines (FLOPs, memory, throughput) is :mod:`modbench.measure`'s."""

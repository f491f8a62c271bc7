"""Analyses of models and runs that need no training: analytic FLOPs and parameter counts."""

from modbench.analysis.flops import FlopReport, flop_report, measure_flops

__all__ = ["FlopReport", "flop_report", "measure_flops"]

"""modbench: does this Transformer modification really help, once everything else is fixed?"""

from modbench.errors import ModbenchError

__version__ = "0.1.0"

__all__ = ["ModbenchError", "__version__"]

"""``python -m modbench.train ARGS``: ``modbench train ARGS`` in this process. It is what
each process of a torchrun group runs::

    torchrun --standalone --nproc_per_node 2 -m modbench.train --preset tiny --out runs/t

(``modbench train --nproc 2 ...`` and :func:`modbench.train.distributed.launch` start such a
group.)"""

import sys

from modbench.train.cli import main

sys.exit(main())

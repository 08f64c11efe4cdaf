"""What the test fork server imports once (see :mod:`tests.helpers.warm_start`).

Imported inside the fork server, each library under its own ``try``: the server dies on any error
other than ``ImportError`` in a preloaded module (every launch would then fail with a bare
``EOFError``), while a library that cannot be imported here is simply left to each rank, whose
own import then fails with the real error in its log.
"""
import importlib

LIBRARIES = ("torch", "torch.distributed", "lightning.pytorch", "torchmetrics", "transformers.modeling_utils")

for _name in LIBRARIES:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - reported by the rank that needs it, with its traceback
        pass

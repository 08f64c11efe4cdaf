"""megastrategy: Megatron-LM parallelism for unchanged PyTorch Lightning modules."""
from megastrategy import load_from_checkpoint
from megastrategy.errors import MegatronConfigError
from megastrategy.registry import register_when_lightning_loads

register_when_lightning_loads()  # Trainer(strategy="megatron_tp2"): see megastrategy.registry
load_from_checkpoint.install()  # MyModule.load_from_checkpoint(<checkpoint directory>): see that module

__version__ = "0.1.0"
__all__ = ["MegatronStrategy", "MegatronConfigError", "grad_norm", "__version__"]


def __getattr__(name):
    # Lazy so that `import megastrategy.pipeline` does not pull in Lightning.
    if name == "MegatronStrategy":
        from megastrategy.strategy import MegatronStrategy

        return MegatronStrategy
    if name == "grad_norm":  # Lightning's grad_norm with one device's keys and values (ddp/whole_grad_norm.py)
        from megastrategy.ddp.whole_grad_norm import grad_norm

        return grad_norm
    raise AttributeError(f"module 'megastrategy' has no attribute {name!r}")

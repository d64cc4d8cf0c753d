"""Where computations run: meshes, shardings, and decomposed collective einsums."""

from parallelism.collective_einsum import collective_einsum, run_decision  # noqa: F401
from parallelism.decision import explain  # noqa: F401
from parallelism.sharding import plan_layers  # noqa: F401

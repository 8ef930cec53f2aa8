from tests import typecheck  # noqa: F401  (the runtime type checker the jaxtyping hook names)

"""lens_parallel: parallel/perpendicular geometry of attention-head outputs, on TransformerLens.

Everything a user calls is importable from here: models and data, edits, the analyses (each returns a result
implementing :class:`Result`), the sweep engine, compression, training, the report battery and
:func:`load_result`. The names are listed once, in ``__init__.pyi``, and each is imported on first use
(``lazy_loader``): ``import lens_parallel`` costs milliseconds, and torch, TransformerLens and the analyses load
when first needed. A name read from here has its docstring's ``Args`` and ``Returns`` written
(:mod:`lens_parallel.docstrings`), so that ``help(lp.decompose)`` lists every parameter, its type and default.
"""

__version__ = "0.27.0"

import lazy_loader

from lens_parallel import logs  # noqa: F401  (first: its filters precede transformers)

_lazy_getattr, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)


def __getattr__(name: str) -> object:
    from lens_parallel.docstrings import complete

    return complete(_lazy_getattr(name))

"""lens_parallel: parallel/perpendicular geometry of attention-head outputs, on TransformerLens.

Everything a user calls is importable from here: models and data, edits, the analyses (each returns a result
implementing :class:`Result`), the sweep engine, compression, training, the report battery and
:func:`load_result`. The names are listed once, in ``__init__.pyi``, and each is imported on first use
(``lazy_loader``): ``import lens_parallel`` costs milliseconds, and torch, TransformerLens and the analyses load
when first needed.
"""

__version__ = "0.18.0"

import lazy_loader

from lens_parallel import logs  # noqa: F401  (first: its filters precede transformers)

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)

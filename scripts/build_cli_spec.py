"""Write the command line's saved parser (``lens_parallel/assets/cli_spec.json``) from the package's options objects.

    python scripts/build_cli_spec.py

Run after changing an options object, a subcommand, a named protocol or a training preset; the outputs are
committed, and ``tests/test_options.py`` fails while the saved parser is not current.
"""

from __future__ import annotations

from lens_parallel.commands import write_spec

if __name__ == "__main__":
    print("wrote", write_spec())

"""Write the support matrix and the table of features into the architectures guide
(docs/guides/architectures.md), between their markers: one row per architecture, read off its toy, and one per
feature (lens_parallel.support). tests/test_architectures.py checks every row's claims and that the guide holds
exactly these tables.

    python scripts/architecture_matrix.py
"""

from __future__ import annotations

from pathlib import Path

from lens_parallel import support

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "architectures.md"


def main() -> None:
    rows = [support.support_row(model_type) for model_type in support.matrix_model_types()]
    text = GUIDE.read_text()
    text = support.replace_between(text, support.MATRIX_START, support.MATRIX_END, support.matrix_markdown(rows))
    text = support.replace_between(text, support.FEATURES_START, support.FEATURES_END, support.features_markdown())
    GUIDE.write_text(text)
    print(f"wrote {GUIDE}: {len(rows)} architectures")


if __name__ == "__main__":
    main()

"""Whether the Hugging Face hub can be reached (found once per process), and the offline task standing in for an
lm-eval task whose data live on the hub.

Offline, ``datasets`` retries the hub for about a minute before failing with a traceback. :func:`hub_offline`
answers at once (``HF_HUB_OFFLINE``, else one connection attempt to the hub's endpoint with a short timeout), and
while it says offline the task loading runs with the hub switched off
(:func:`hub_offline_mode`: the ``datasets`` cache, else one error per task), so a task whose
data cannot be reached is named at once, with its offline alternative where there is one (``data.alternative``).
"""

from __future__ import annotations

import contextlib
import functools
import socket
from collections.abc import Iterator
from urllib.parse import urlparse

from lens_parallel import compat

HUB_TIMEOUT_S = 3.0
"""How long the one connection attempt to the hub may take before the hub counts as unreachable."""

STAND_INS = {"gsm8k": "gsm8k_cot", "nq_open": "nq_open_validation_shots"}
"""lm-eval tasks whose offline alternative is another task than theirs on another split: GSM8K's test items with
``gsm8k_cot``'s 8 fixed exemplars; NQ-Open with its shots drawn from validation (no training split ships)."""

OWN_SHOTS = frozenset({"gsm8k_cot"})
"""Stand-ins that keep their own fixed exemplars whatever the shots asked of the task they stand in for."""

NO_OFFLINE_SOURCE = {
    "bbh": (
        "BIG-Bench Hard's items are on the Hugging Face hub only (lukaemon/bbh); PyPI's bigbench (0.0.1, its only "
        "release) ships BIG-bench's code without its tasks' data"
    ),
}
"""Why a task family has no offline alternative (by the task name's first part), said when it is left out."""


@functools.cache
def hub_offline() -> bool:
    """Whether the Hugging Face hub cannot be reached: ``HF_HUB_OFFLINE`` set, or no connection to its endpoint
    (``HF_ENDPOINT``, default huggingface.co) within :data:`HUB_TIMEOUT_S`. Asked once per process."""
    import huggingface_hub.constants

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return True
    url = urlparse(huggingface_hub.constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "huggingface.co", port), timeout=HUB_TIMEOUT_S).close()
    except OSError:
        return True
    return False


def why_missing(task: str) -> str:
    """Why ``task`` cannot run offline, in a few words."""
    family = task.split("_")[0]
    return NO_OFFLINE_SOURCE.get(family, "its data are on the Hugging Face hub and no offline copy ships")


@contextlib.contextmanager
def hub_offline_mode(offline: bool) -> Iterator[None]:
    """Inside, when ``offline``, ``datasets`` and ``huggingface_hub`` act as under ``HF_HUB_OFFLINE=1`` (read from
    their caches or fail at once, where they would otherwise retry the network for about a minute)."""
    if not offline:
        yield
        return
    compat.check("datasets")
    import datasets.config
    import huggingface_hub.constants

    before = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = before

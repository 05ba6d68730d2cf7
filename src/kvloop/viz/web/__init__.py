"""The web view of the loop: one page, shipped in the package, fed either a recorded trace
(``kvloop trace view``) or a live server's steps (``/dashboard`` in ``kvloop serve``).

The page is plain JavaScript with no dependencies and no network access beyond its own
server; every text taken from a trace or a request is inserted as text, never as markup.
"""

from kvloop.viz.web.assets import ASSET_NAMES, asset, page
from kvloop.viz.web.payload import record_dicts, trace_payload, words

__all__ = ["ASSET_NAMES", "asset", "page", "record_dicts", "trace_payload", "words"]

"""The headers every answer of a kvloop web page carries (the live dashboard and
``kvloop trace view``): only the page's own files run, nothing is cached. Stdlib only."""

from __future__ import annotations

SECURITY_HEADERS: dict[str, str] = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "style-src 'self'; script-src 'self'; object-src 'none'; "
                               "base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}
"""Headers of a web page's answers: only the page's own files run."""

"""What went wrong talking to the Hub, as one line that names the repo (and file) and the fix.

`explain` turns a huggingface_hub / httpx / OS exception into that line; `redact` takes any token
out of it (the token is never printed or logged). quantkit.hub.repo.Repo.error puts the two together.
"""

from __future__ import annotations

import errno
import os
import re

import httpx
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)


def explain(exc: BaseException, where: str, *, endpoint: str, revision: str) -> str:
    """The one-line message (with a fix) for `exc`, raised while working on `where` (`repo@commit[ file 'x']`)."""
    if isinstance(exc, GatedRepoError):
        return f"{where}: gated repository; fix: accept its terms on the model page, then set HF_TOKEN to a token of that account"
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"{where}: repository not found or not accessible at {endpoint}; fix: check the repo id, "
            "or set HF_TOKEN (or --token) to a token with read access for private/gated repos"
        )
    if isinstance(exc, RevisionNotFoundError):
        return f"{where}: revision {revision!r} not found; fix: pass an existing branch, tag or full commit sha"
    if isinstance(exc, RemoteEntryNotFoundError):
        return f"{where}: file not found at this commit; fix: check the file name (see the repo's file list)"
    if isinstance(exc, OfflineModeIsEnabled):
        return f"{where}: offline mode (HF_HUB_OFFLINE) blocks this download; fix: unset HF_HUB_OFFLINE"
    if isinstance(exc, HfHubHTTPError):
        return _http_error(exc, where, endpoint)
    if isinstance(exc, httpx.TransportError):
        return (
            f"{where}: network error talking to {endpoint} ({type(exc).__name__}: {exc}); "
            "fix: check connectivity and re-run (partial downloads resume), or set HF_HUB_OFFLINE=1 to use local files"
        )
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return f"{where}: disk full; fix: free space (partial downloads are kept and resume)"
    if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
        return f"{where}: download ended early ({str(exc).splitlines()[0]}); fix: re-run, the partial file resumes"
    return f"{where}: {type(exc).__name__}: {exc}; fix: re-run, or report this with the log"


def _http_error(exc: HfHubHTTPError, where: str, endpoint: str) -> str:
    status = exc.response.status_code if exc.response is not None else "?"
    hint = exc.response.headers.get("X-Error-Message", "") if exc.response is not None else ""
    if status == 401:
        fix = "check HF_TOKEN / --token (expired or revoked?)"
    elif status == 403:
        fix = "use a token with read access to this repo (and accept its terms if gated)"
    elif status == 416:
        fix = "delete the partial file under .cache/quantkit/incomplete and re-run"
    else:
        fix = "re-run later; completed files are kept and partial ones resume"
    return f"{where}: HTTP {status} from {endpoint}{f' ({hint})' if hint else ''}; fix: {fix}"


def redact(text: str, token: str | None) -> str:
    """`text` without the token (`token`, else $HF_TOKEN) and without anything shaped like an HF token."""
    tok = token
    if tok is None:
        tok = os.environ.get("HF_TOKEN")
    if tok and len(tok) >= 4:
        text = text.replace(tok, "***")
    return re.sub(r"hf_[A-Za-z0-9]{8,}", "hf_***", text)

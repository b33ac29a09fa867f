"""``Repo``: one Hub model repo at a pinned commit, and every request made to the Hub for it.

``Repo.open`` checks the user's id; ``resolve()`` turns a revision into a commit and the full file list
(online: one ``model_info`` call; offline: a manifest written by an earlier run, else an HF cache
snapshot; quantkit.hub.listing).  The Hub requests a download needs (``file_metadata``, ``get``,
``read_range``) and the look-up in the HF cache (``from_hf_cache``) are methods here, so that the
token never leaves this class and every failure becomes one line with a fix (``error``,
quantkit.hub.failures).  Making a file complete and verified on disk is quantkit.hub.transfer.
"""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import EntryNotFoundError
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers

from quantkit.hub import failures, listing
from quantkit.hub.names import parse_hf_id
from quantkit.hub.store import Cancelled, HubError, NoBar, RemoteFile, Sink

# ---------------------------------------------------------------------------------------------------------------
# the environment, read when a Repo is made (huggingface_hub reads it once, at import time)
# ---------------------------------------------------------------------------------------------------------------


def _is_true(value: str | None) -> bool:
    return str(value).strip().upper() in {"1", "ON", "YES", "TRUE"}


def offline_mode() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read now."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var) is not None:
            return _is_true(os.environ[var])
    return bool(constants.HF_HUB_OFFLINE)


def endpoint_url(endpoint: str | None) -> str:
    """`endpoint`, else HF_ENDPOINT, else huggingface_hub's default; no trailing slash."""
    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def default_hf_cache() -> Path:
    """The HF hub cache, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


# ---------------------------------------------------------------------------------------------------------------
# the repo at a pinned commit
# ---------------------------------------------------------------------------------------------------------------


class Repo:
    def __init__(self, repo_id: str, revision: str | None, *, endpoint: str | None, token: str | None, hf_cache: Path | None,
                 allow_unverified: bool = False):
        self.repo_id = repo_id
        self.allow_unverified = allow_unverified
        self.unverified: list[str] = []  # files accepted on size alone (allow_unverified)
        self.revision = revision or constants.DEFAULT_REVISION
        self.endpoint = endpoint_url(endpoint)
        self._token = token  # None => huggingface_hub reads HF_TOKEN / the stored token; never logged
        self.hf_cache = Path(hf_cache) if hf_cache is not None else default_hf_cache()
        self.offline = offline_mode()
        self.commit: str = ""
        self.files: dict[str, RemoteFile] = {}
        self.listing_source = ""

    @classmethod
    def open(cls, spec: str, revision: str | None = None, *, endpoint: str | None, token: str | None,
             hf_cache: Path | None, allow_unverified: bool = False) -> "Repo":
        """The repo a user's id names (``hf://org/repo[@rev]`` or ``org/repo[@rev]``); `revision` may
        name the revision instead of the id, not as well (unless the two agree)."""
        repo_id, spec_rev = parse_hf_id(spec)
        if revision and spec_rev and revision != spec_rev:
            raise HubError(f"{spec}: revision given twice ({spec_rev!r} and {revision!r}); fix: pass only one")
        return cls(repo_id, revision or spec_rev, endpoint=endpoint, token=token, hf_cache=hf_cache,
                   allow_unverified=allow_unverified)

    def __repr__(self) -> str:
        return f"Repo({self.repo_id!r}, commit={self.commit[:12]!r})"

    @property
    def label(self) -> str:
        return f"{self.repo_id}@{self.commit[:12]}" if self.commit else f"{self.repo_id}@{self.revision}"

    # -- errors ---------------------------------------------------------------------------------------------
    def error(self, exc: BaseException, filename: str | None = None) -> HubError:
        """Translate a huggingface_hub / httpx / OS error into a one-line HubError with a fix."""
        if isinstance(exc, HubError):
            return exc
        where = self.label + (f" file {filename!r}" if filename else "")
        msg = failures.explain(exc, where, endpoint=self.endpoint, revision=self.revision)
        return HubError(self.redact(msg), repo_id=self.repo_id, filename=filename)

    def redact(self, text: str) -> str:
        return failures.redact(text, self._token)

    # -- listing --------------------------------------------------------------------------------------------
    def resolve(self, manifests: list[Path]) -> None:
        """Pin the commit and learn the file list: online from the Hub; offline from the first of
        `manifests` that is for this repo and revision, else from an HF cache snapshot."""
        if self.offline:
            self.resolve_offline(manifests)
        else:
            self.resolve_online()

    def resolve_online(self) -> None:
        """One ``model_info(files_metadata=True)`` call: revision -> commit, and the full file list."""
        try:
            info = HfApi(endpoint=self.endpoint, token=self._token).model_info(
                self.repo_id, revision=self.revision, files_metadata=True
            )
        except Exception as e:
            raise self.error(e) from e
        self._adopt(listing.from_model_info(self.repo_id, info, self.label, self.allow_unverified))

    def resolve_offline(self, manifests: list[Path]) -> None:
        """Offline: the file list comes from a manifest we wrote earlier, else from an HF cache snapshot."""
        found = listing.from_manifests(self.repo_id, self.revision, manifests, self.allow_unverified)
        self._adopt(found if found is not None else listing.from_hf_cache(self.repo_id, self.revision, self.hf_cache))

    def _adopt(self, got: listing.Listing) -> None:
        self.commit, self.files, self.listing_source = got.commit, got.files, got.source
        self.unverified.extend(got.unverified)

    # -- requests for one file ------------------------------------------------------------------------------
    def url(self, rf: RemoteFile) -> str:
        """The file's ``/resolve/{commit}/{path}`` URL."""
        return hf_hub_url(self.repo_id, rf.name, revision=self.commit, endpoint=self.endpoint)

    def file_metadata(self, rf: RemoteFile):
        """The HEAD of the file at the pinned commit (commit, size, etag), with retries."""
        try:
            return get_hf_file_metadata(self.url(rf), token=self._token, endpoint=self.endpoint, retry_on_errors=True)
        except Exception as e:
            raise self.error(e, rf.name) from e

    def get(self, rf: RemoteFile, sink: Sink, resume: int) -> None:
        """The file's bytes from offset `resume` on, written to `sink` (``http_get``: ranged GET, in-run
        retries on dropped connections, a size check at the end). ``Cancelled`` passes through."""
        # "identity": byte ranges must address the file itself, not a gzip stream of it
        headers = build_hf_headers(token=self._token, headers={"Accept-Encoding": "identity"})
        try:
            http_get(
                self.url(rf),
                sink,  # type: ignore[arg-type]
                resume_size=resume,
                headers=headers,
                expected_size=rf.size,
                displayed_filename=rf.name,
                tqdm_class=NoBar,  # type: ignore[arg-type]
            )
        except Cancelled:
            raise
        except Exception as e:
            raise self.error(e, rf.name) from e

    def read_range(self, rf: RemoteFile, start: int, length: int) -> bytes:
        """``length`` (> 0) bytes of the file from ``start``, with one ranged GET."""
        from huggingface_hub.utils import get_session

        headers = build_hf_headers(token=self._token, headers={"Accept-Encoding": "identity", "Range": f"bytes={start}-{start + length - 1}"})
        try:
            r = get_session().get(self.url(rf), headers=headers, follow_redirects=True)
            r.raise_for_status()
        except Exception as e:
            raise self.error(e, rf.name) from e
        data = r.content
        if r.status_code == 200:  # server ignored the range
            data = data[start:start + length]
        return data

    def from_hf_cache(self, rf: RemoteFile) -> Path | None:
        """A complete copy of this file at this commit in the HF cache (``hf_hub_download(local_files_only=True)``)."""
        if not self.hf_cache.is_dir():
            return None
        try:
            p = hf_hub_download(
                self.repo_id,
                rf.name,
                revision=self.commit,
                cache_dir=self.hf_cache,
                local_files_only=True,
                token=False,
            )
        except (EntryNotFoundError, OSError, ValueError):
            return None
        path = Path(p)
        try:
            if path.stat().st_size != rf.size:
                return None
        except OSError:
            return None
        return path

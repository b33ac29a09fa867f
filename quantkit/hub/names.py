"""Names that come from outside and become paths or folder names here: the user's model id, and the
commit, file names and checksums of a Hub listing. Each is checked before it is used; a bad one is a
one-line HubError with the fix (a listing that fails these checks is not trusted at all).
"""

from __future__ import annotations

import re

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from quantkit.hub.store import STATE, HubError, RemoteFile

SHA256 = re.compile(r"[0-9a-f]{64}")
SHA1 = re.compile(r"[0-9a-f]{40}")


def parse_hf_id(spec: str) -> tuple[str, str | None]:
    """``"hf://org/repo@rev"``, ``"org/repo@rev"`` or ``"org/repo"`` -> ``(repo_id, rev or None)``."""
    s = spec.strip()
    for prefix in ("hf://", "https://huggingface.co/", "http://huggingface.co/"):
        if s.startswith(prefix):
            s = s[len(prefix) :]
            break
    repo_id, at, rev = s.partition("@")
    repo_id = repo_id.strip("/")
    if at and not rev:
        raise HubError(f"bad model id {spec!r}: empty revision after '@'; fix: write org/repo@<branch|tag|commit>")
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise HubError(f"bad model id {spec!r}; fix: write hf://org/repo[@revision] or org/repo[@revision]") from None
    if "/" not in repo_id:
        raise HubError(f"bad model id {spec!r}: expected org/repo; fix: write hf://org/repo[@revision]")
    return repo_id, (rev or None)


def repo_folder(repo_id: str) -> str:
    """The repo's folder name in an HF-style cache: ``models--org--repo``."""
    return "models--" + repo_id.replace("/", "--")


def check_name(repo_id: str, name: str) -> None:
    """A listed file name becomes a path under the cache: every component must be a plain name
    (no '..', no separators, no NUL or control characters, at most 255 bytes; the whole at most 1024)."""
    parts = name.split("/") if isinstance(name, str) else [""]
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or any(p in ("", ".", "..") for p in parts)
        or tuple(parts[:2]) == STATE
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
        or any(len(p.encode("utf-8", "surrogatepass")) > 255 for p in parts)
        or len(name) > 1024
    ):
        raise HubError(f"{repo_id}: refusing unsafe file name {name!r:.80} from the Hub listing (path components must be "
                       "plain names of at most 255 bytes); fix: check HF_ENDPOINT points to a trusted Hub", repo_id=repo_id)


def check_commit(repo_id: str, commit, where: str) -> str:
    """The commit becomes a folder name under snapshots/: it must be a 40-hex git sha."""
    if not isinstance(commit, str) or not SHA1.fullmatch(commit):
        raise HubError(f"{repo_id}: {where} gave commit {str(commit)[:60]!r}, not a 40-hex git sha; refusing it "
                       "(it would name a folder); fix: check HF_ENDPOINT points to a trusted Hub", repo_id=repo_id)
    return commit


def check_checksums(repo_id: str, rf: RemoteFile, allow_unverified: bool) -> bool:
    """True when `rf` has a well-formed checksum; False (accepted on size alone) only with
    allow_unverified; otherwise a HubError."""
    if rf.sha256 is not None and not SHA256.fullmatch(str(rf.sha256)):
        raise HubError(f"{repo_id} file {rf.name!r}: malformed sha256 {str(rf.sha256)[:70]!r} in the Hub listing; "
                       "fix: check HF_ENDPOINT points to a trusted Hub", repo_id=repo_id, filename=rf.name)
    if rf.blob_id is not None and not SHA1.fullmatch(str(rf.blob_id)):
        raise HubError(f"{repo_id} file {rf.name!r}: malformed blob id {str(rf.blob_id)[:50]!r} in the Hub listing; "
                       "fix: check HF_ENDPOINT points to a trusted Hub", repo_id=repo_id, filename=rf.name)
    if rf.sha256 or rf.blob_id:
        return True
    if not allow_unverified:
        raise HubError(f"{repo_id} file {rf.name!r}: the Hub listing gives no checksum (no LFS sha256, no blob id), so "
                       "it could only be checked by size; fix: check HF_ENDPOINT, or pass --allow-unverified to accept "
                       "such files (recorded in the report)", repo_id=repo_id, filename=rf.name)
    return False

"""Model specs: what users may pass wherever a model is expected.

- a folder with config.json and safetensors shards;
- `tiny:<name>` (one of quantkit.synthetic.tiny.TINY_NAMES): the embedded tiny models (built on first use);
- `realshape:kimi-k2.6` / `realshape:glm-5.2`: real-width, 2-layer synthetic checkpoints
  (quantkit.synthetic.realshape; built on first use, ~1.2-1.7 GB);
- `hf://org/repo@rev`: a Hugging Face repo at a pinned commit, streamed: configs and tokenizer are
  fetched at once, every shard's header with a ranged read, and each shard only when a tensor in
  it is first needed (quantkit.hub.source.HubSource).
"""

from __future__ import annotations

from pathlib import Path

from quantkit.checkpoint.reader import Checkpoint
from quantkit.errors import ConfigError


def is_tiny(spec) -> bool:
    return isinstance(spec, str) and spec.startswith("tiny:")


def is_realshape(spec) -> bool:
    return isinstance(spec, str) and spec.startswith("realshape:")


def is_hub(spec) -> bool:
    return isinstance(spec, str) and spec.startswith("hf://")


def resolve(spec: str | Path) -> Path:
    """A local folder for `spec`; tiny models are generated into the cache on first use."""
    if is_tiny(spec):
        from quantkit.synthetic.tiny import tiny_path

        return tiny_path(spec[len("tiny:"):])
    if is_realshape(spec):
        from quantkit.synthetic.realshape import realshape_path

        return realshape_path(spec[len("realshape:"):])
    if is_hub(spec):
        return hub_source(spec).local_path("config.json").parent
    path = Path(spec)
    if not path.is_dir():
        raise ConfigError(f"{spec}: not a folder, a tiny:<name> id or an hf://org/repo@rev id")
    return path


def hub_source(spec: str, **kwargs):
    """The HubSource for an `hf://org/repo@rev` spec, cached under the quantkit cache folder."""
    from quantkit.hub.source import HubSource
    from quantkit.runtime.files import cache_dir

    return HubSource(spec, cache_dir=kwargs.pop("cache_dir", cache_dir()), **kwargs)


def open_checkpoint(spec: str | Path, *, release_consumed: bool = False, allow_unverified: bool = False) -> Checkpoint:
    """`allow_unverified`: accept Hub files that the listing gives no checksum for (size only)."""
    if is_hub(spec):
        ckpt = Checkpoint(None, remote=hub_source(spec, allow_unverified=allow_unverified), release_consumed=release_consumed)
    else:
        ckpt = Checkpoint(resolve(spec))
    warn_absent_mtp(ckpt)
    return ckpt


def warn_absent_mtp(ckpt: Checkpoint) -> None:
    """One warning line when config.json declares MTP layers the shards do not hold (the reader
    converts without them; quantkit.checkpoint.reader.Checkpoint._drop_absent_mtp)."""
    import sys

    from quantkit.model.arch import NO_MTP

    n = ckpt.absent_mtp_layers
    if n:
        print(f"warning: {Path(ckpt.folder) / 'config.json'}: num_nextn_predict_layers is {n} but the shards hold no "
              f"tensor of layer{'s' if n > 1 else ''} {ckpt.arch.num_hidden_layers}"
              f"{f'..{ckpt.arch.num_hidden_layers + n - 1}' if n > 1 else ''} (as transformers' save_pretrained leaves "
              f"it); reading it without: {NO_MTP}", file=sys.stderr)

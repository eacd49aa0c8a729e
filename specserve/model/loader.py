"""Hugging Face checkpoint directory -> our CausalLM: config.json, *.safetensors, tokenizer.

Nothing is downloaded: `path` is a local directory. Every failure is a ModelLoadError that
names the directory or file and, for weights, the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from specserve.errors import ModelLoadError
from specserve.model.llama import SUPPORTED_ARCHITECTURES, CausalLM, ModelArgs

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}  # fmt: skip


def _model_dir(path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {path}")
    return path


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{file} is not valid JSON: {e}") from None
    except OSError as e:
        raise ModelLoadError(f"cannot read {file}: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def load_hf_config(path):
    """config.json of a checkpoint directory as a transformers PretrainedConfig, after
    checking that its architecture is one we implement."""
    path = _model_dir(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"config.json not found in {path}")
    data = _read_json(config_file)
    archs = data.get("architectures") or []
    if not isinstance(archs, list):
        raise ModelLoadError(f"{config_file}: architectures must be a list, e.g. [\"LlamaForCausalLM\"], got {archs!r}")
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{config_file}: unsupported architecture {', '.join(map(str, archs)) or '<none given>'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many kinds; say which file
        raise ModelLoadError(f"{config_file}: transformers cannot parse it: {e}") from e


def resolve_dtype(dtype, args: ModelArgs, device) -> torch.dtype:
    """"auto" = the checkpoint's dtype, except that on CPU bfloat16/float16 become float32
    (CPU matmuls in half precision are slow and gain nothing); float32 if the config names none."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        resolved = _DTYPES.get(str(args.torch_dtype), torch.float32)
        if torch.device(device).type == "cpu" and resolved in (torch.bfloat16, torch.float16):
            resolved = torch.float32
        return resolved
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use 'auto' or one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def hf_weight_names(args: ModelArgs) -> dict[str, str]:
    """Our parameter name -> the Hugging Face tensor name, spelled out for every tensor."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not args.tie_word_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(args.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        names[ours + "attention_norm.weight"] = hf + "input_layernorm.weight"
        names[ours + "ffn_norm.weight"] = hf + "post_attention_layernorm.weight"
        for our_proj, hf_proj in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")):
            names[ours + f"attention.{our_proj}.weight"] = hf + f"self_attn.{hf_proj}.weight"
            if args.qkv_bias:
                names[ours + f"attention.{our_proj}.bias"] = hf + f"self_attn.{hf_proj}.bias"
        names[ours + "attention.wo.weight"] = hf + "self_attn.o_proj.weight"
        if args.qk_norm:
            names[ours + "attention.q_norm.weight"] = hf + "self_attn.q_norm.weight"
            names[ours + "attention.k_norm.weight"] = hf + "self_attn.k_norm.weight"
        names[ours + "feed_forward.w1.weight"] = hf + "mlp.gate_proj.weight"
        names[ours + "feed_forward.w3.weight"] = hf + "mlp.up_proj.weight"
        names[ours + "feed_forward.w2.weight"] = hf + "mlp.down_proj.weight"
    return names


def _is_ignorable(hf_name: str, args: ModelArgs) -> bool:
    """Tensors some checkpoints carry that we recompute or share."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return True
    return args.tie_word_embeddings and hf_name == "lm_head.weight"


def _safetensors_files(path: Path) -> list[Path]:
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_file} has no 'weight_map'")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"shard {f.name} listed in {index_file} is missing")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    # Mistral repositories also ship consolidated.safetensors in Meta's naming: not ours.
    files = sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("consolidated"))
    if files:
        return files
    if list(path.glob("pytorch_model*.bin")):
        raise ModelLoadError(
            f"{path} has only pytorch_model*.bin weights, which are not supported (pickle files are "
            "unsafe to load); convert them to safetensors, e.g. load with transformers and "
            "save_pretrained(dir, safe_serialization=True)"
        )
    raise ModelLoadError(f"no *.safetensors weight files in {path}")


def load_model(path, dtype="auto", device="cpu", progress: bool = True) -> tuple[CausalLM, ModelArgs]:
    """Build our CausalLM from a local HF checkpoint directory.

    dtype: "auto" (the config's dtype; on CPU bfloat16/float16 are loaded as float32 for
    speed), a torch.dtype, or a name such as "bfloat16". Every tensor of the checkpoint must
    map onto one of ours with the same shape, and every one of ours must be present.
    """
    path = _model_dir(path)
    args = ModelArgs.from_hf_config(load_hf_config(path))
    dtype = resolve_dtype(dtype, args, device)
    files = _safetensors_files(path)

    with torch.device("meta"):  # no random init of weights we overwrite anyway
        model = CausalLM(args, dtype=dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    model.init_rope_tables()

    ours_by_hf = {hf: ours for ours, hf in hf_weight_names(args).items()}
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    handles = []
    for f in files:
        try:
            handles.append((f, safe_open(str(f), framework="pt", device="cpu")))
        except Exception as e:
            raise ModelLoadError(f"cannot read safetensors file {f}: corrupt or truncated ({e})") from None
    total = sum(len(h.keys()) for _, h in handles)
    with tqdm(total=total, desc=f"loading {path.name}", unit="tensor", disable=not progress) as bar:
        for f, handle in handles:
            for hf_name in handle.keys():
                bar.update(1)
                ours = ours_by_hf.get(hf_name)
                if ours is None:
                    if not _is_ignorable(hf_name, args):
                        unexpected.append(f"{hf_name} (in {f.name})")
                    continue
                try:
                    tensor = handle.get_tensor(hf_name)
                except Exception as e:
                    raise ModelLoadError(f"cannot read tensor {hf_name} from {f}: {e}") from None
                param = params[ours]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ModelLoadError(
                        f"tensor {hf_name} in {f} has shape {list(tensor.shape)}, expected "
                        f"{list(param.shape)} from config.json"
                    )
                with torch.no_grad():
                    param.copy_(tensor)
                    if not bool(torch.isfinite(param).all()):   # it would serve garbage, silently
                        raise ModelLoadError(f"tensor {hf_name} in {f} holds NaN or infinite values "
                                             f"(as {param.dtype} too): the checkpoint is damaged")
                loaded.add(hf_name)
    if unexpected:
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise ModelLoadError(
            f"unexpected tensors in {path} that {args.architecture} does not use: "
            f"{', '.join(unexpected[:5])}{more}"
        )
    missing = sorted(set(ours_by_hf) - loaded)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(
            f"missing tensor(s) in {', '.join(f.name for f in files)} ({path}): {', '.join(missing[:5])}{more}"
        )
    model.fuse_projections()
    if torch.device(device).type == "cuda":
        model.keep_transposed_weights()   # linear as one mm: host time per layer on the GPU
    model.eval()
    return model, args


def load_tokenizer(path):
    """The checkpoint's fast tokenizer (tokenizer.json + tokenizer_config.json)."""
    path = _model_dir(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ModelLoadError(f"no tokenizer.json or tokenizer_config.json in {path}")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), use_fast=True, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {e}") from e


def load_sampling_defaults(path) -> dict:
    """The model's own sampling defaults: generation_config.json's temperature, top_p, top_k
    and repetition_penalty, for requests that leave them out (as vLLM applies them); {} when
    it names none. A value SamplingParams refuses is an error naming the file."""
    from specserve.errors import InvalidRequestError
    from specserve.sampling import SamplingParams

    file = _model_dir(path) / "generation_config.json"
    data = _read_json(file) if file.is_file() else {}
    defaults = {name: data[name] for name in ("temperature", "top_p", "top_k", "repetition_penalty")
                if data.get(name) is not None}
    try:
        SamplingParams(**defaults)
    except (InvalidRequestError, TypeError) as e:
        raise ModelLoadError(f"{file}: {e}") from None
    return defaults


def load_eos_token_ids(path) -> list[int]:
    """End-of-sequence ids: generation_config.json's eos_token_id (an int or a list; Llama 3
    lists several), else config.json's; [] if neither names one."""
    path = _model_dir(path)
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if not file.is_file():
            continue
        eos = _read_json(file).get("eos_token_id")
        if eos is None:
            continue
        ids = [eos] if isinstance(eos, int) else eos
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ModelLoadError(f"{file}: eos_token_id must be an int or a list of ints, got {eos!r}")
        return list(ids)
    return []

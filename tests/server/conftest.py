"""A real server on a loopback port, its event loop on a background thread, so tests drive it
with the official synchronous `openai` client (or raw aiohttp) from the test thread."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import config as config_mod
from specserve.engine import LLMEngine
from tests.checkpoints import make_checkpoint

MAX_MODEL_LEN = 256


class ServerThread:
    """create_app + AppRunner + TCPSite(127.0.0.1, port 0) on a loop of its own."""

    def __init__(self, engine: LLMEngine, cfg):
        from specserve.server.app import create_app, make_runner

        self.engine, self.cfg = engine, cfg
        self.app = create_app(engine, cfg)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.thread.start()
        self.runner = make_runner(self.app)

        async def start():
            from aiohttp import web

            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return self.runner.addresses[0][1]

        self.port = self.call(start())
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/v1"

    def call(self, coro, timeout: float = 60.0):
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url, api_key="x", max_retries=0, timeout=60.0, **kwargs)

    def stop(self):
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)



def http(base: str, path: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, dict]:
    """(status, JSON body) of a GET (body None) or POST."""
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class SseStream(threading.Thread):
    """A streaming completion (POST /v1/completions with `body`) on a thread of its own: `first`
    is set at its first event; `events` holds every data line; `error` the exception the client
    raised. `on_chunk` runs after each chunk; after `close_after` chunks the client goes away
    (the request is aborted)."""

    def __init__(self, base: str, body: dict, on_chunk=None, close_after: int | None = None):
        super().__init__(daemon=True)
        self.base, self.body = base, {**body, "stream": True}
        self.on_chunk, self.close_after = on_chunk, close_after
        self.first = threading.Event()
        self.id: str | None = None
        self.events: list[str] = []
        self.error: BaseException | None = None
        self.start()

    def run(self):
        req = urllib.request.Request(self.base + "/v1/completions", data=json.dumps(self.body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    line = line.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    self.events.append(line[6:])
                    if not self.first.is_set():
                        self.id = json.loads(line[6:]).get("id")
                        self.first.set()
                    if self.on_chunk is not None:
                        self.on_chunk()
                    if self.close_after is not None and len(self.events) >= self.close_after:
                        return
        except BaseException as e:   # reported by the test
            self.error = e
        finally:
            self.first.set()

    def chunks(self) -> list[dict]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    @property
    def text(self) -> str:
        return "".join(c["choices"][0]["text"] for c in self.chunks() if c.get("choices"))

    def outcome(self) -> str:
        """"error: <message>" (one error event, then [DONE]) or the last chunk's finish_reason;
        AssertionError for anything else."""
        assert self.error is None, self.error
        assert self.events and self.events[-1] == "[DONE]", self.events[-3:]
        chunks = self.chunks()
        errors = [c for c in chunks if "error" in c]
        if errors:
            assert len(errors) == 1 and chunks[-1] is errors[0], self.events[-4:]
            return "error: " + errors[0]["error"]["message"]
        return chunks[-1]["choices"][0]["finish_reason"]


def engine_config(target: Path, draft: Path | str | None = None, **overrides):
    cfg = config_mod.default()
    kw = dict(target=str(target), dtype="float32", device="cpu", num_blocks=256, block_size=8,
              max_model_len=MAX_MODEL_LEN)
    if draft is None or draft in ("ngram", "none"):
        kw["draft_kind"] = draft or "none"
    else:
        kw["draft"] = str(draft)
    kw.update(overrides)
    return config_mod.with_overrides(cfg, **kw)


def start_server_process(target: Path, *args: str) -> tuple[subprocess.Popen, int, list[str]]:
    """`specserve serve` on `target` in a child process, on a free port: (the process, its port,
    its log up to the line that says it serves)."""
    cmd = [sys.executable, "-c", "import sys; from specserve.cli import main; sys.exit(main(sys.argv[1:]))",
           "serve", "--target", str(target), "--device", "cpu", "--dtype", "float32", "--num-blocks", "64",
           "--port", "0", *args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        log.append(line)
        if m := re.search(r"on http://127\.0\.0\.1:(\d+)", line):
            return proc, int(m.group(1)), log
    proc.kill()
    proc.wait()
    raise AssertionError("the server did not start:\n" + "".join(log))


def concurrently(fn, count: int, timeout: float = 300.0) -> list:
    """[fn(0), ..., fn(count - 1)], all called at once on threads of their own."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(fn, range(count), timeout=timeout))


@contextlib.contextmanager
def ray_deployment(cfg, num_cpus: int, **build_kwargs):
    """(base URL, the ingress handle) of specserve on Ray Serve on a local Ray cluster of
    `num_cpus`, at the route prefix "/"; Serve and Ray are shut down after."""
    import msgspec
    import ray
    from ray import serve

    from specserve.server.ray_serve import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        ingress = serve.run(build_app(msgspec.to_builtins(cfg), **build_kwargs), name="specserve", route_prefix="/")
        yield f"http://127.0.0.1:{port}", ingress
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture(scope="session")
def server_target(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("server_target"), "llama", seed=0, num_hidden_layers=2)


@pytest.fixture(scope="session")
def server_draft(tmp_path_factory, server_target):
    """The target with noise on its lm_head: a draft that is right often but not always (about
    a third of draft tokens accepted at depth 3), so streams see both accepted runs and rejections."""
    draft = tmp_path_factory.mktemp("server_draft") / "draft"
    shutil.copytree(server_target, draft)
    weights = load_file(str(draft / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    weights["lm_head.weight"] += 0.05 * torch.randn(weights["lm_head.weight"].shape, generator=g)
    save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})
    return draft


@pytest.fixture(scope="module")
def server(server_target, server_draft):
    """The target with a draft model: every request here also exercises speculation."""
    cfg = engine_config(server_target, server_draft, spec_mode="static", spec_depth=3)
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    yield srv
    srv.stop()


# -- a checkpoint whose greedy output is known in advance ------------------------------------

SCRIPT = "Tokyo 東京🙂 done."


def make_successor_checkpoint(dir: Path, text: str = SCRIPT) -> tuple[Path, list[int]]:
    """A one-layer llama that is a lookup table: greedy decoding after token a emits succ(a),
    where succ follows the tokens of `text` and then EOS. Attention and MLP outputs are zeroed
    (o_proj, down_proj), so the final hidden state is the current token's embedding; with
    one-hot embeddings (hidden >= vocab) the logits are lm_head[:, a]. Returns (dir, ids of text)."""
    from transformers import AutoTokenizer

    dir = make_checkpoint(dir, "llama", seed=0, num_hidden_layers=1, hidden_size=512, intermediate_size=64,
                          num_attention_heads=4, num_key_value_heads=2)
    tok = AutoTokenizer.from_pretrained(str(dir))
    ids = tok.encode(text)
    assert len(set(ids)) == len(ids), f"{text!r} repeats a token; a successor table cannot follow it"
    file = dir / "model.safetensors"
    w = load_file(str(file))
    vocab, hidden = w["model.embed_tokens.weight"].shape
    assert hidden >= vocab
    w["model.embed_tokens.weight"] = torch.eye(vocab, hidden)
    w["model.norm.weight"] = torch.ones(hidden)
    w["model.layers.0.self_attn.o_proj.weight"].zero_()
    w["model.layers.0.mlp.down_proj.weight"].zero_()
    lm_head = torch.zeros(vocab, hidden)
    for a, b in zip(ids, ids[1:] + [tok.eos_token_id]):
        lm_head[b, a] = 1.0
    w["lm_head.weight"] = lm_head
    save_file(w, str(file), metadata={"format": "pt"})
    return dir, ids

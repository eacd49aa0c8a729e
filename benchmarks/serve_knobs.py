"""Serve extra adaptive controllers, each with some constructor arguments changed, from one
server process, for `sweep --one-process --knobs`: a setting NAME is switched to like
``adaptive`` (POST /admin/speculation {"mode": NAME}), and then NAME's controller plans and
learns while the others stand detached.

    python -m benchmarks.serve_knobs --knobs nobias:bias_half_life=0 \\
        --knobs calm:explore_interval=16,explore_margin=0.08 serve --config configs/tiny.toml --admin-api

Why one process: two server processes of the same code run the same step at different speeds
(10-15% apart at 16 requests on the dev CPU, sweep s21a), more than most controller changes
move the throughput, so an A/B of two processes measures the processes. Here every controller
runs on the same process through the same spells of the machine, in cells interleaved with the
static depths and with the start-up controller (``adaptive``).

A knob controller is a copy of the start-up controller (calibration and everything it has
learned by then) made when the server is first switched to it, with the attributes its
arguments set in ``AdaptiveController.__init__`` set as a controller built with them would
have them: so a knob that seeds an estimate (``prior_acceptance``) starts that estimate over.
From then on it learns on its own steps only. Arguments that size the controller's tables
(``max_depth``, ``max_num_nodes``) or its mode cannot be knobs.

One knob is not a constructor argument: ``shadow_depth=D`` has the controller plan and learn
every step as usual while each step runs static depth D (no early stop). Beside ``staticD``
in the same process, the difference is what the controller's own work costs the server (its
Python, and whatever it does to the passes around it), with the depths the same.
"""

from __future__ import annotations

import copy
import inspect
import sys

FIXED = {"mode", "max_depth", "max_num_nodes", "static_depth", "static_num_nodes"}
SHADOW = "shadow_depth"


def parse_knobs(specs: list[str]) -> dict[str, dict[str, object]]:
    """['NAME:key=value,key=value', ...] -> {NAME: {key: value}}; values are Python literals
    (numbers, tuples, True/False/None). SystemExit naming what is wrong."""
    import ast

    from specserve.controller import AdaptiveController

    params = inspect.signature(AdaptiveController.__init__).parameters
    out: dict[str, dict[str, object]] = {}
    for spec in specs:
        name, sep, body = spec.partition(":")
        if not sep or not name or not body:
            raise SystemExit(f"serve_knobs: --knobs {spec!r}: expected NAME:key=value[,key=value...]")
        if name in ("adaptive", "static") or name in out or not name.replace("_", "").replace("-", "").isalnum():
            raise SystemExit(f"serve_knobs: --knobs name {name!r} must be a new word (not adaptive or static)")
        knobs: dict[str, object] = {}
        for item in _split_top(body):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or (key not in params and key != SHADOW) or key == "self":
                raise SystemExit(f"serve_knobs: --knobs {name}: {key!r} is not an AdaptiveController argument "
                                 f"(one of: {', '.join(k for k in params if k != 'self')})")
            if key == SHADOW:
                try:
                    knobs[key] = int(value)
                except ValueError:
                    raise SystemExit(f"serve_knobs: --knobs {name}: {SHADOW} needs an integer depth, got {value!r}") from None
                continue
            if key in FIXED:
                raise SystemExit(f"serve_knobs: --knobs {name}: {key!r} sizes the controller or sets its mode; "
                                 "it cannot differ inside one process")
            try:
                knobs[key] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                raise SystemExit(f"serve_knobs: --knobs {name}: {key}={value!r} is not a Python literal") from None
        out[name] = knobs
    return out


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets: 'a=1,b=(0.6, 1.5)' -> ['a=1', 'b=(0.6, 1.5)']."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p for p in parts if p.strip()]


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if hasattr(a, "__dict__") and not isinstance(a, type):
        va, vb = vars(a), vars(b)
        return va.keys() == vb.keys() and all(_same(va[k], vb[k]) for k in va)
    if hasattr(type(a), "__slots__") and not isinstance(a, (list, dict, tuple)):
        return all(_same(getattr(a, s, None), getattr(b, s, None)) for s in type(a).__slots__)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _apply(target, base, changed) -> None:
    """Set on target each attribute where `changed` (a fresh controller with the knobs) differs
    from `base` (a fresh one without): into objects attribute by attribute, whole otherwise."""
    for key, value in vars(changed).items():
        old = vars(base).get(key)
        if _same(old, value):
            continue
        if hasattr(value, "__dict__") and type(value) is type(old) and not isinstance(value, type):
            _apply(getattr(target, key), old, value)
        else:
            setattr(target, key, copy.deepcopy(value))


def knob_controller(start: object, knobs: dict[str, object]) -> object:
    """A copy of the start-up controller `start` with `knobs` applied (see the docstring)."""
    cls = type(start)
    knobs = dict(knobs)
    shadow = knobs.pop(SHADOW, None)
    shape = dict(mode="adaptive", max_depth=start.max_depth, max_num_nodes=start.max_num_nodes,
                 stop_scale=start.stop_scale)
    try:
        changed = cls(**{**shape, **knobs})   # a knob may set stop_scale too
    except (TypeError, ValueError) as e:
        raise ValueError(f"knobs {knobs}: {e}") from None
    out = copy.deepcopy(start)
    _apply(out, cls(**shape), changed)
    if shadow is not None:
        if not 0 <= shadow <= start.max_depth:
            raise ValueError(f"knobs {knobs}: {SHADOW} must be in 0..{start.max_depth}, got {shadow}")
        _shadow(out, shadow)
    return out


def _shadow(controller, depth: int) -> None:
    """Have `controller` plan as usual and run `depth` every step (see the module docstring)."""
    from specserve.controller import Plan

    planned = controller.plan

    def plan(batch_size, request_ids=(), context_tokens=None, depth_caps=None, decoded_tokens=None, sampled=None):
        planned(batch_size, request_ids, context_tokens, depth_caps, decoded_tokens, sampled)
        controller.stop_below = controller.level_below = 0.0
        return Plan(depth, depth)

    controller.plan = plan


def install(knobs: dict[str, dict[str, object]], cls: type | None = None) -> None:
    """Teach the Speculator class (`cls`, default specserve.spec.Speculator) the knob settings:
    set_setting(NAME) attaches NAME's controller (made on first use), setting() reports it,
    and a finished request is forgotten by every controller."""
    from specserve import spec as spec_mod

    cls = cls or spec_mod.Speculator
    plain_set, plain_setting, plain_forget_history = cls.set_setting, cls.setting, cls.forget_history

    def set_setting(self, mode, depth=None):
        if mode not in knobs:
            setting = plain_set(self, mode, depth)   # a refused setting changes nothing
            self._knob_name = None
            return setting
        if depth is not None:
            raise spec_mod.InvalidRequestError(f"'depth' is only for mode 'static' ({mode!r} is an adaptive "
                                               "controller)", param="depth")
        if self.adaptive is None:
            raise spec_mod.InvalidRequestError("knob controllers need the start-up adaptive controller: start "
                                               "the server in mode 'adaptive'", param="mode")
        made = self.__dict__.setdefault("_knob_controllers", {})
        if mode not in made:
            made[mode] = knob_controller(self.adaptive, knobs[mode])
        self.controller = made[mode]
        self._knob_name = mode
        return self.setting()

    def setting(self):
        name = getattr(self, "_knob_name", None)
        return {"mode": name} if name is not None and self.controller is not None else plain_setting(self)

    def forget_history(self, request_id, num_tokens=None):
        plain_forget_history(self, request_id, num_tokens)
        for c in getattr(self, "_knob_controllers", {}).values():
            c.forget(request_id, num_tokens)

    cls.set_setting, cls.setting, cls.forget_history = set_setting, setting, forget_history


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    specs = []
    while len(argv) >= 2 and argv[0] == "--knobs":
        specs.append(argv[1])
        argv = argv[2:]
    if not specs or not argv:
        raise SystemExit("usage: python -m benchmarks.serve_knobs --knobs NAME:key=value[,...] [--knobs ...] "
                         "serve [specserve serve arguments ...]")
    install(parse_knobs(specs))
    from specserve import cli

    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())

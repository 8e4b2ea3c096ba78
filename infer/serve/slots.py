"""Slots: named saved states (``POST /slots/{name}?action=save|restore|erase``).

infer's server has no fixed slots (requests share one paged pool), so a
*slot* here is what llama.cpp's server lets one save and restore: a named
state file in the folder given by ``--slot-save-path``
(:mod:`infer.saved_state`). ``save`` computes the state of the prompt or
conversation in the body (what the prefix cache holds of it is not computed
again) and writes it; ``restore`` enters a saved one in the prefix cache, so
the next request that starts with it computes only the rest (its usage
reports ``cached_tokens``); ``erase`` deletes it. Names are confined to the
folder: one path component of letters, digits, ``.``, ``_`` and ``-``, not
starting with a dot (so no ``../``). Saving and restoring run on the engine
thread between two steps, like the retrieval endpoints.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.errors import RequestError
from infer.saved_state import load_state, save_state
from infer.serve.protocol import ServerLike

#: A slot's name: one path component, no leading dot.
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
ACTIONS = ("save", "restore", "erase")


def slot_path(folder: Path | None, name: str) -> Path:
    """The file of slot ``name`` in ``folder``; a name that could leave the
    folder, or no folder, is a :class:`~infer.errors.RequestError`."""
    if folder is None:
        raise RequestError("slots are off: start the server with --slot-save-path DIR to save and restore them",
                           None, status=501, code="slots_disabled")
    if not NAME.fullmatch(name) or ".." in name:
        raise RequestError(f"slot name {name!r}: use letters, digits, '.', '_' and '-' (at most 128, not starting "
                           "with '.'); a slot cannot name a path outside the slot folder", "name",
                           code="invalid_slot_name")
    path = folder / name
    if path.resolve().parent != folder.resolve():  # belt and braces: a symlinked folder entry
        raise RequestError(f"slot {name!r} is outside the slot folder", "name", code="invalid_slot_name")
    return path


def _source(body: Any) -> Any:
    """What a save body names: ``prompt`` (text or token ids) or ``messages``."""
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        raise RequestError("a slot save takes a JSON body with one of prompt (text or token ids) and messages "
                           "(a conversation)", "prompt")
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
        return messages
    prompt = body["prompt"]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise RequestError("prompt must be a non-empty text or list of token ids", "prompt")


async def slots(server: ServerLike, request: Request) -> Response:
    """``POST /slots/{name}?action=save|restore|erase``."""
    name = request.path_params["name"]
    action = request.query_params.get("action")
    if action not in ACTIONS:
        raise RequestError(f"action must be one of {', '.join(ACTIONS)}, got {action!r}", "action")
    path = slot_path(server.slot_save_path, name)
    model, batch = server.model, server.loop.batch
    start = time.perf_counter()
    if action == "erase":
        if not path.is_file():
            raise RequestError(f"there is no slot {name!r}", "name", status=404, code="slot_not_found")
        path.unlink()
        return JSONResponse({"slot": name, "action": "erase", "n_erased": 1})
    if action == "save":
        source = _source(await server.read_body(request))
        saved = await server.loop.call(lambda: save_state(model, path, source, batch))
        return JSONResponse({"slot": name, "action": "save", "filename": name, "n_saved": len(saved.tokens),
                             "n_written": saved.nbytes,
                             "timings": {"save_ms": round((time.perf_counter() - start) * 1000, 3)}})
    if not path.is_file():
        raise RequestError(f"there is no slot {name!r}", "name", status=404, code="slot_not_found")
    restored = await server.loop.call(lambda: load_state(model, path, batch))
    return JSONResponse({"slot": name, "action": "restore", "filename": name, "n_restored": len(restored.tokens),
                         "n_cached": restored.cached, "n_read": path.stat().st_size,
                         "timings": {"restore_ms": round((time.perf_counter() - start) * 1000, 3)}})

"""The driver running a fixed batch of prompts offline (`meshserve generate`)."""

from __future__ import annotations

import json
import sys

from meshserve.comm.messages import SamplingParams
from meshserve.engine.engine import Engine
from meshserve.engine.offline import generate
from meshserve.engine.admission import RequestError


class GenerateMode:
    def __init__(self, prompts: list[str], params: SamplingParams, chat: bool, as_json: bool):
        self.prompts, self.params, self.chat, self.as_json = prompts, params, chat, as_json

    def prepare(self, config, tokenizer, info, memory) -> None:
        pass

    def run(self, engine: Engine) -> int:
        tok = engine.tokenizer
        inputs = [tok.apply_chat_template([{"role": "user", "content": p}]) if self.chat else p for p in self.prompts]
        try:
            results = generate(engine, inputs, self.params)
        except RequestError as e:
            print(f"meshserve: bad request: {e.message}", file=sys.stderr)
            return 1
        for i, (prompt, result) in enumerate(zip(self.prompts, results), 1):
            if self.as_json:
                print(json.dumps({"prompt": prompt, "text": result.text, "token_ids": result.token_ids,
                                  "finish_reason": result.finish_reason}), flush=True)
            elif len(self.prompts) == 1:
                print(result.text, flush=True)
            else:  # a header per prompt: the texts may span lines, or be empty
                print(f"{'' if i == 1 else chr(10)}[{i}/{len(self.prompts)}] {prompt}\n{result.text}", flush=True)
        return 0

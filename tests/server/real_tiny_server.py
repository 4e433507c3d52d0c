"""A real (tiny, random Llama) engine behind the in-process test server, with the openai
client of one tenant: for the modules that check OpenAI fields against transformers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import openai

from loraplex.engine.async_engine import AsyncLLMEngine
from tests.engine.test_engine_exact import tight_llm
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.server.conftest import RunningServer, start_server


@dataclass
class TinyServer:
    client: openai.OpenAI
    model: str  # the served name of the base model
    folder: Path  # the model directory, for transformers' reference
    srv: RunningServer
    engine: AsyncLLMEngine

    def stop(self) -> None:
        self.client.close()
        self.srv.stop()
        self.engine.shutdown()


def start_tiny_server(tmp_path_factory, seed: int) -> TinyServer:
    folder = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=seed)
    llm = tight_llm(folder, tmp_path_factory.mktemp("home"), num_blocks=64, max_num_batched_tokens=256)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    srv = start_server(tmp_path_factory.mktemp("srv"), engine)
    client = openai.OpenAI(base_url=f"{srv.url}/t/acme/v1", api_key=srv.make_tenant("acme"), max_retries=0,
                           timeout=60)
    return TinyServer(client, srv.app.state.ctx.served_model_name, folder, srv, engine)

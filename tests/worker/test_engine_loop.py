"""The engine thread's heartbeat: how long the current step has run, read while it runs."""

from __future__ import annotations

import asyncio

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.worker.engine_loop import EngineLoop
from tests.sim.conftest import LLAMA_8B_SHAPE, sim_config, write_config_only_model


def test_step_age_grows_during_a_long_step_and_is_zero_when_idle(tmp_path) -> None:
    model_dir = write_config_only_model(tmp_path, LLAMA_8B_SHAPE)
    # A simulated prefill of 200 tokens, stretched to about a second of wall time.
    engine = LLMEngine(sim_config(model_dir, time_scale=200.0))

    async def run() -> tuple[float, list[float], float]:
        loop = EngineLoop(engine, asyncio.get_running_loop())
        try:
            idle = loop.step_age()
            stream = loop.open_stream("r")
            params = SamplingParams(max_tokens=1, ignore_eos=True)
            await loop.acall(lambda: engine.add_request("r", list(range(10, 210)), params))
            ages = []
            while stream.empty():
                ages.append(loop.step_age())  # the actor's event loop reads it mid-step
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)
            return idle, ages, loop.step_age()
        finally:
            loop.stop()

    idle, ages, after = asyncio.run(run())
    assert idle == 0.0 and after == 0.0
    assert max(ages) >= 0.3, ages
    assert ages == sorted(ages)  # one step: its age only grows

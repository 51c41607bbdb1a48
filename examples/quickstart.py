"""Plan GPT-ref (12 blocks, 8 x 256 tokens) to half its eager memory, then measure both."""

import planner
from benchmarks.models import gpt_ref_example

model, example_input = gpt_ref_example()
eager = planner.measure(model, example_input)

p = planner.plan(model, example_input, mem_budget_gb=0.5 * eager.peak_bytes / 1e9)
print(p.summary())

after = planner.measure(p.module, example_input)  # p.module trains in the model's place
print(
    f"measured peak: {eager.peak_bytes / 2**20:.1f} MiB eager -> "
    f"{after.peak_bytes / 2**20:.1f} MiB planned ({p.solver}); "
    f"step time {eager.step_time_s:.2f} s -> {after.step_time_s:.2f} s"
)

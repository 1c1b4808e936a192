"""The benchmark: tok/s and acceptance of plain decoding (baseline), n-gram, the incumbent and the candidate,
measured by engines behind one interface.

    job.py        BenchJob (what every engine measures on), the protocol of an engine module, run_engine
    figures.py    what more than one engine builds its figures with
    reference.py  the project's reference speculative decoder on this machine; calibration.py is how it
                  chooses its draft setting, decoded.py its decodes as figures
    vllm.py       vLLM engines, one per method (its CPU build here, its GPU build in a benchmark pod)
    sglang.py     SGLang servers, one per method in turn (production)

The engine a run config names (benchmark.engine) is the one the drafter will be served with, and its speed
decides (pipeline.promotion). Beside vLLM the reference decoder can run too (benchmark.reference_beside): it
measures at the serving engine's setting, and the serving engine's acceptance must match its own, counted as
the serving engine counts; its own timing is reported beside, not decisive.

The engines' table (ENGINES) and the `benchmark:` section of a run config, with each engine's own settings,
are in pipeline.benchmark_settings: the config is read by every stage and imports nothing of the engines.

Adding an engine: a module here with `measure(job: BenchJob) -> EngineBench` (pipeline.benchmark.job) and a
row in ENGINES; settings of its own go in a section of BenchmarkConfig, beside the others.
"""

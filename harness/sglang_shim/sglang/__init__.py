"""The rehearsal's `sglang`: on the rehearsal's SGLang image (and only there, through its PYTHONPATH),
`python -m sglang.launch_server ...` runs the stand-in server (harness.sglang_standin) with the same
flags, so manifests and configs that start SGLang run unchanged. SGLang itself needs CUDA."""

"""The harness: what runs the pipeline's deployed path on this machine and stands in for what cannot run
here (a local Kubernetes cluster and its container runtime, the SGLang stand-in, alert sinks, a local
Airflow, the production rehearsal). It imports `pipeline`; nothing in `pipeline` imports it, and it is
not part of the package that pyproject.toml builds."""

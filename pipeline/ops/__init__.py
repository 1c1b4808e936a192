"""Operations around the pipeline: the drafter registry, run reports, capacity planning, and where
tasks run (deployment, SGLang fleets, the Kubernetes API)."""

"""Apache Airflow as the trainer, SGLang and vLLM images have it: not at all. Their Dockerfiles install the
project without its `airflow` extra, while the local cluster's pods run on this machine's virtualenv,
which has Airflow. First on such a pod's PYTHONPATH (harness/rehearsal.py, `_images`), this module makes
`import airflow` fail there as it fails in the built image. The cncf provider's pod script tries the import
and goes on without it (python_kubernetes_script.jinja2); pipeline code that needed Airflow in those pods
would fail here as in production."""

raise ModuleNotFoundError("No module named 'airflow' (not installed in this image)", name="airflow")

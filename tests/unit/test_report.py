"""Report links never carry credentials."""

from pipeline.ops.report import report_link
from pipeline.storage import S3Store


def test_links_point_at_the_object_without_credentials():
    aws = S3Store("drafter-pipeline", "kimi", region="eu-west-1")
    link = report_link(aws, "runs/r1/report/report.html")
    assert link == (
        "https://s3.console.aws.amazon.com/s3/object/drafter-pipeline?region=eu-west-1"
        "&prefix=kimi/runs/r1/report/report.html"
    )
    local = S3Store("bucket", "p", endpoint_url="http://127.0.0.1:9000")
    assert (
        report_link(local, "runs/r1/report/report.html")
        == "http://127.0.0.1:9000/bucket/p/runs/r1/report/report.html"
    )
    for url in (link, report_link(local, "runs/r1/report/report.html")):
        assert "X-Amz" not in url and "Signature" not in url  # never a presigned URL


def test_the_report_names_a_non_default_architecture_and_says_when_no_engine_here_loads_it():
    from pipeline.ops.report import RunRecord, architecture_rows

    def rows(architecture):
        return dict(architecture_rows(RunRecord("r1", config={"drafter": {"architecture": architecture}})))

    assert rows("eagle3") == {} and architecture_rows(RunRecord("r1")) == []
    assert rows("eagle3.1") == {"drafter architecture": "eagle3.1"}
    mla = rows("eagle3-mla")
    assert mla["drafter architecture"] == "eagle3-mla"
    assert mla["engines here"].startswith("no engine here loads an eagle3-mla drafter: vLLM 0.32.0 registers")
    assert "cpu_mla.py" in mla["engines here"] and "SGLang 0.5.23 serves it" in mla["engines here"]

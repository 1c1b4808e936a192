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

    def rows(architecture, no_engine_here=None):
        train = {"result": {"no_engine_here": no_engine_here}}
        config = {"drafter": {"architecture": architecture}}
        return dict(architecture_rows(RunRecord("r1", config=config, train=train)))

    assert rows("eagle3") == {} and architecture_rows(RunRecord("r1")) == []
    assert rows("eagle3.1") == {"drafter architecture": "eagle3.1"}
    assert rows("eagle3-mla") == {
        "drafter architecture": "eagle3-mla"
    }  # Kimi's 576-wide latent: vLLM takes it
    said = "no engine here loads this eagle3-mla drafter: its MLA latent is 24 wide"  # what training recorded
    assert rows("eagle3-mla", said) == {"drafter architecture": "eagle3-mla", "engines here": said}

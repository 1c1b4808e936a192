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

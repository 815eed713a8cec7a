"""Local mode's spot price history (spot_training.local.spot_prices): the moto server answers
DescribeSpotPriceHistory from the dated table in the repository, so a local deployment's cost and
savings are the ones a user would have seen on the table's date, and the drill's report says so."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import boto3
import pytest
from botocore.config import Config

from spot_training.cli import _read_back_lines
from spot_training.local import spot_prices
from spot_training.local.cluster_drill import ClusterDrillOptions
from spot_training.local.drill import DrillOptions, price_source, table_on_demand_prices
from spot_training.ops import operations as ops

STACK = "PriceTest"
TAGS = [{"Key": "spot-training:stack", "Value": STACK}]
#: moto's us-east-1 zone IDs (moto/ec2/models/availability_zones_and_regions.py)
ZONE_IDS = {"us-east-1a": "use1-az6", "us-east-1b": "use1-az1"}


def test_the_shipped_table_is_dated_sourced_and_prices_the_drill_types():
    table = spot_prices.load_table()
    assert dt.date.fromisoformat(table.as_of) <= dt.date.today()
    assert "https://" in table.source and table.region == "us-east-1"
    for itype in DrillOptions().instance_types:
        assert 0 < min(table.spot[itype].values()) < table.on_demand[itype]
    assert DrillOptions().on_demand_prices == {t: table.on_demand[t] for t in ("g5.xlarge", "g4dn.xlarge")}


def test_the_cluster_drill_prices_come_from_the_same_table(monkeypatch):
    table = spot_prices.load_table()
    moved = dataclasses.replace(table, on_demand={t: price * 2 for t, price in table.on_demand.items()})
    monkeypatch.setattr(spot_prices, "load_table", lambda: moved)
    types = ("g5.xlarge", "g4dn.xlarge", "m5.large", "m5.xlarge")
    assert ClusterDrillOptions().on_demand_prices == {t: table.on_demand[t] * 2 for t in types}


@pytest.mark.parametrize("change, named", [
    (lambda d: d.pop("as_of"), "as_of"),
    (lambda d: d.update(as_of="28.11.2026"), "as_of"),
    (lambda d: d.update(source=""), "source"),
    (lambda d: d["instance_types"]["g5.xlarge"].update(on_demand=0), "g5.xlarge.on_demand"),
    (lambda d: d["instance_types"]["g5.xlarge"]["spot"].update({"us-east-1a": 0.4}), "Availability Zone IDs"),
])
def test_a_bad_table_is_refused_naming_the_field(tmp_path, change, named):
    data = json.loads(spot_prices.TABLE_PATH.read_text())
    change(data)
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=named):
        spot_prices.load_table(path)


def test_history_maps_zone_names_to_ids_and_honours_the_filters():
    table = spot_prices.load_table()
    zones = {"us-east-1a": "use1-az6", "us-east-1b": "use1-az1", "us-east-1e": "use1-az3"}
    items = spot_prices.history(table, zones, region="us-east-1", instance_types=["g5.xlarge"])
    # use1-az3 has no g5.xlarge price in the table: not offered there, no point (as EC2 answers)
    assert {(i["AvailabilityZone"], float(i["SpotPrice"])) for i in items} == {
        ("us-east-1a", table.spot["g5.xlarge"]["use1-az6"]), ("us-east-1b", table.spot["g5.xlarge"]["use1-az1"])}
    assert all(i["Timestamp"].startswith(table.as_of) and i["ProductDescription"] == "Linux/UNIX" for i in items)
    assert [i["AvailabilityZone"] for i in spot_prices.history(
        table, zones, region="us-east-1", filters={"availability-zone": ["us-east-1b"], "instance-type": ["g4dn.xlarge"]})
    ] == ["us-east-1b"]
    assert spot_prices.history(table, zones, region="eu-west-1") == []
    assert spot_prices.history(table, zones, region="us-east-1", product_descriptions=["Windows"]) == []
    assert spot_prices.history(table, zones, region="us-east-1",
                               end_time=table.timestamp - dt.timedelta(days=1)) == []


def test_a_local_deployment_costs_what_the_table_says(moto_server):
    """Spot instances of two types in two zones of the local AWS, priced by ``spot-train cost``'s code:
    each row's hourly cost is the table's price for its type and zone ID, the savings are SageMaker's
    formula over the table's spot and on-demand prices, and the drill's report lines name the table's date."""
    table = spot_prices.load_table()
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto_server.endpoint_url,
                       aws_access_key_id="testing", aws_secret_access_key="testing",
                       config=Config(retries={"mode": "standard"}))
    boto3.client("cloudformation", region_name="us-east-1", endpoint_url=moto_server.endpoint_url,
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_stack(
        StackName=STACK, TemplateBody=json.dumps({"Resources": {"Logs": {"Type": "AWS::Logs::LogGroup"}}}))
    placed = {("g5.xlarge", "us-east-1a"), ("g4dn.xlarge", "us-east-1b")}
    for itype, az in sorted(placed):
        ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, InstanceType=itype,
                          Placement={"AvailabilityZone": az}, InstanceMarketOptions={"MarketType": "spot"},
                          TagSpecifications=[{"ResourceType": "instance", "Tags": TAGS}])
    aws = ops.connect(region="us-east-1", endpoint_url=moto_server.endpoint_url, credentials=("testing", "testing"))
    on_demand = table_on_demand_prices(["g5.xlarge", "g4dn.xlarge"])
    now = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=30)  # half an hour of running
    cost = json.loads(ops.to_json(ops.cost_report(aws, STACK, now=now, on_demand=on_demand)))

    assert {(r["instance_type"], r["availability_zone"]) for r in cost["rows"]} == placed
    for row in cost["rows"]:
        spot = table.spot[row["instance_type"]][ZONE_IDS[row["availability_zone"]]]
        assert row["hours"] == pytest.approx(0.5, abs=0.01)
        assert row["spot_cost_usd"] == pytest.approx(row["hours"] * spot)
        assert row["on_demand_cost_usd"] == pytest.approx(row["hours"] * table.on_demand[row["instance_type"]])
    per_type = [1 - table.spot[t][ZONE_IDS[az]] / table.on_demand[t] for t, az in placed]
    assert min(per_type) * 100 <= cost["savings_pct"] <= max(per_type) * 100
    assert 55 < cost["savings_pct"] < 70  # g5.xlarge 0.4036/1.006 and g4dn.xlarge 0.2025/0.526 on the table's date

    lines = "\n".join(_read_back_lines({"cost": cost, "prices": price_source(on_demand, ["g5.xlarge", "g4dn.xlarge"])}))
    assert f"spot price history and on-demand prices as of {table.as_of}, from spot_prices.json" in lines
    assert "skypilot-catalog" in lines

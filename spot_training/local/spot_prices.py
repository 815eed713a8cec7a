"""Local mode's spot price history: a dated table of real prices, served by the moto server.

moto 5.2.5 answers ``DescribeSpotPriceHistory`` with one placeholder price, 0.00001 USD/hour for every
type in every Availability Zone, stamped 2006-01-02 (``moto/ec2/responses/spot_instances.py``), so a
drill's spot cost came out as a millionth of a dollar and its savings as 99.999 %. This module puts
real figures in their place: ``spot_prices.json`` beside it holds, for the instance types local mode
runs, the Linux/UNIX spot price per Availability Zone **ID** and the Linux on-demand price, with the
date they were read and their source (both in the file). :func:`apply`, called inside the moto
server process (``spot_training.local.moto_server``), makes ``DescribeSpotPriceHistory`` answer from
the table; ``spot-train cost`` (``spot_training.ops.operations.cost_report``) then prices a local
deployment exactly as it prices a real one.

Why a patch of moto's response handler: moto has no API to set the spot price history (nor a
backend attribute holding prices: the price is a constant in the handler), so the handler itself is
replaced, in the server process only; agents and operations code talk to the server over HTTP as
to EC2 and are unchanged.

How the table maps onto the local AWS, as EC2 does it:

- Prices are per Availability Zone ID (``use1-az6``), because zone names are shuffled per account;
  each zone name of the moto region is mapped to its ID with moto's own zone table (us-east-1a is
  use1-az6 there).
- Each (type, zone) has one price point, stamped with the table's date at 00:00 UTC: the price in
  effect since then. EC2's history also returns the point in effect at ``StartTime`` when it is
  older than ``StartTime`` ("DescribeSpotPriceHistory", Amazon EC2 API Reference), which is what a
  cost report over the drill's minutes needs.
- A type the table lists but not in some zone is not offered there: no point (EC2 answers the same).
- A type the table does not list keeps moto's placeholder (so nothing else changes); the drill's
  report names the table and its types, so such a type shows up as not priced by it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import threading
from pathlib import Path
from typing import Any

#: The table local mode serves (date and source inside).
TABLE_PATH = Path(__file__).with_name("spot_prices.json")

_lock = threading.Lock()
_state: dict[str, Any] = {"table": None, "original": None}


@dataclasses.dataclass(frozen=True)
class PriceTable:
    """The spot price table (``spot_prices.json``), validated.

    Attributes:
        as_of: the date the figures were read, ``YYYY-MM-DD``.
        source: where they come from, in words with the URL (from the file).
        region: the AWS Region of the prices, e.g. ``us-east-1``.
        product_description: EC2's ``ProductDescription`` of the prices, e.g. ``Linux/UNIX``.
        on_demand: ``{instance type: on-demand USD/hour}``.
        spot: ``{instance type: {AZ ID: spot USD/hour}}``.
        path: the file it was read from.
    """

    as_of: str
    source: str
    region: str
    product_description: str
    on_demand: dict[str, float]
    spot: dict[str, dict[str, float]]
    path: Path

    @property
    def timestamp(self) -> dt.datetime:
        """The price points' ``Timestamp``: ``as_of`` at 00:00 UTC."""
        return dt.datetime.fromisoformat(self.as_of).replace(tzinfo=dt.timezone.utc)

    def describe(self) -> dict[str, Any]:
        """What a report says about the prices: ``as_of``, ``source``, ``path``, ``region``, ``instance_types``."""
        return {"as_of": self.as_of, "source": self.source, "path": str(self.path), "region": self.region,
                "instance_types": sorted(self.spot)}


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{where} must be a positive USD/hour number, got {value!r}")
    return float(value)


def load_table(path: str | Path = TABLE_PATH) -> PriceTable:
    """Read and check a spot price table.

    Args:
        path: the JSON file (default: :data:`TABLE_PATH`). Keys: ``as_of`` (``YYYY-MM-DD``),
            ``source`` (non-empty), ``region``, ``product_description``, ``instance_types``:
            ``{type: {"on_demand": USD/h, "spot": {AZ ID: USD/h}}}``.

    Returns:
        The :class:`PriceTable`.

    Raises:
        ValueError: a missing or bad field, named with its value and what is expected.
        OSError: the file cannot be read.
    """
    path = Path(path)
    data = json.loads(path.read_text())
    as_of = data.get("as_of")
    if not isinstance(as_of, str) or not re.fullmatch(r"\d{4}-\d{2}-\d{2}", as_of):
        raise ValueError(f"{path}: as_of must be a date YYYY-MM-DD, got {as_of!r}")
    dt.date.fromisoformat(as_of)
    for key in ("source", "region", "product_description"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise ValueError(f"{path}: {key} must be a non-empty string, got {data.get(key)!r}")
    types = data.get("instance_types")
    if not isinstance(types, dict) or not types:
        raise ValueError(f"{path}: instance_types must map instance types to prices, got {types!r}")
    on_demand, spot = {}, {}
    for itype, entry in types.items():
        on_demand[itype] = _positive((entry or {}).get("on_demand"), f"{path}: {itype}.on_demand")
        zones = (entry or {}).get("spot")
        if not isinstance(zones, dict) or not zones:
            raise ValueError(f"{path}: {itype}.spot must map Availability Zone IDs to prices, got {zones!r}")
        spot[itype] = {}
        for zone_id, price in zones.items():
            if not re.fullmatch(r"[a-z]+\d?-az\d+", zone_id):
                raise ValueError(f"{path}: {itype}.spot keys must be Availability Zone IDs like use1-az6, got {zone_id!r}")
            spot[itype][zone_id] = _positive(price, f"{path}: {itype}.spot.{zone_id}")
    return PriceTable(as_of=as_of, source=data["source"], region=data["region"],
                      product_description=data["product_description"], on_demand=on_demand, spot=spot, path=path)


def history(table: PriceTable, zones: dict[str, str], *, region: str, instance_types: list[str] | None = None,
            availability_zone: str | None = None, product_descriptions: list[str] | None = None,
            filters: dict[str, list[str]] | None = None, end_time: dt.datetime | None = None) -> list[dict[str, Any]]:
    """The ``SpotPriceHistory`` items the table gives for a ``DescribeSpotPriceHistory`` call.

    Args:
        table: the price table.
        zones: ``{zone name: zone ID}`` of ``region`` (e.g. ``{"us-east-1a": "use1-az6"}``).
        region: the Region asked; a Region other than the table's gets nothing.
        instance_types, availability_zone, product_descriptions, end_time: the call's parameters
            (None: not given). ``end_time`` before the table's date gets nothing.
        filters: the call's ``Filters`` as ``{name: values}`` (``instance-type``,
            ``availability-zone``, ``product-description``, ``spot-price``; others are ignored).

    Returns:
        Items with ``InstanceType``, ``ProductDescription``, ``SpotPrice`` (a string, as EC2 sends
        it), ``AvailabilityZone`` and ``Timestamp`` (an ISO 8601 string), for the table's types only.
    """
    filters = filters or {}
    if region != table.region or (end_time is not None and end_time < table.timestamp):
        return []
    wanted_products = set(product_descriptions or []) | set(filters.get("product-description", []))
    if wanted_products and not wanted_products & {table.product_description, f"{table.product_description} (Amazon VPC)"}:
        return []
    items = []
    for itype in sorted(table.spot):
        if (instance_types and itype not in instance_types) or \
                ("instance-type" in filters and itype not in filters["instance-type"]):
            continue
        for name, zone_id in sorted(zones.items()):
            price = table.spot[itype].get(zone_id)
            if price is None or (availability_zone and name != availability_zone) or \
                    ("availability-zone" in filters and name not in filters["availability-zone"]) or \
                    ("spot-price" in filters and f"{price:.6f}" not in filters["spot-price"]):
                continue
            items.append({"InstanceType": itype, "ProductDescription": table.product_description,
                          "SpotPrice": f"{price:.6f}", "AvailabilityZone": name,
                          "Timestamp": table.timestamp.strftime("%Y-%m-%dT%H:%M:%S.000Z")})
    return items


def _parse_time(value: Any) -> dt.datetime | None:
    if value in (None, ""):
        return None
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def apply(table_path: str | Path = TABLE_PATH) -> PriceTable:
    """Make this process's moto answer ``DescribeSpotPriceHistory`` from the table (see the module
    docstring). Idempotent; a second call replaces the table.

    Args:
        table_path: the table (default :data:`TABLE_PATH`).

    Returns:
        The loaded :class:`PriceTable`.

    Raises:
        ValueError, OSError: from :func:`load_table` (the server then does not start, saying why).
    """
    table = load_table(table_path)
    from moto.core.responses import ActionResult
    from moto.ec2.models.availability_zones_and_regions import RegionsAndZonesBackend
    from moto.ec2.responses.spot_instances import SpotInstances

    with _lock:
        _state["table"] = table
        if _state["original"] is not None:
            return table
        original = SpotInstances.describe_spot_price_history
        _state["original"] = original

        def describe_spot_price_history(self: Any) -> Any:
            current: PriceTable = _state["table"]
            instance_types = self._get_param("InstanceTypes", []) or None
            availability_zone = self._get_param("AvailabilityZone") or None
            filters = self._filters_from_querystring()
            seeded = set(current.spot)
            # moto's own rows, for the types the table does not price (moto's placeholder stays theirs)
            theirs = [item for item in original(self).result["SpotPriceHistory"]
                      if item["InstanceType"] not in seeded
                      and (not availability_zone or item["AvailabilityZone"] == availability_zone)]
            region = self.ec2_backend.region_name
            zones = {zone.name: zone.zone_id for zone in RegionsAndZonesBackend.zones.get(region, [])}
            ours = history(current, zones, region=region, instance_types=instance_types,
                           availability_zone=availability_zone,
                           product_descriptions=self._get_param("ProductDescriptions", []) or None,
                           filters=filters, end_time=_parse_time(self._get_param("EndTime")))
            return ActionResult({"SpotPriceHistory": ours + theirs})

        SpotInstances.describe_spot_price_history = describe_spot_price_history
    return table

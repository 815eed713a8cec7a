"""The CloudFormation half of local mode's compatibility layer, applied inside our moto server process.

:mod:`spot_training.local.moto_compat` bridges moto 5.2.5's EC2 gaps and the CloudFormation resource types
``AWS::EC2::Volume`` / ``AWS::EC2::SpotFleet`` / ``Fn::GetAZs``; this module bridges what is left
for a real ``cdk deploy`` / ``cdk destroy`` of our stacks. :func:`apply` patches moto's classes in the
server process (``spot_training.local.moto_server._serve`` calls it right after ``moto_compat.apply``). Every
bridge is for moto 5.2.5 and says what real CloudFormation does instead:

1. **Custom resources run for real, on Create and on Delete.** moto invokes a custom resource's
   Lambda through Docker (there is no Docker engine in local mode) in a thread, and never sends
   ``Delete`` when the stack is deleted. Here the handler runs synchronously in a subprocess (the
   moto server's own Python, which has boto3) from the function's deployed code (the S3 asset zip
   that ``cdk deploy`` uploaded, unpacked under ``<work_dir>/lambda/``), with the function's
   environment variables, fake credentials and ``AWS_ENDPOINT_URL`` pointing back at this server.
   A ``custom_resources.Provider`` (whose framework Lambda is Node.js and calls the user's function
   through the Lambda API) is resolved to the user's ``onEvent`` function
   (``USER_ON_EVENT_FUNCTION_ARN``), which gets the event the framework would give it
   (``RequestType``, ``ResourceProperties``, ``PhysicalResourceId`` ...); its result's
   ``PhysicalResourceId`` and ``Data`` become the resource's id and ``Fn::GetAtt`` values. A Python
   function that is itself the service token is run the same way. A handler that fails fails the
   Create or Delete with its error (as the framework reports FAILED to CloudFormation).
   Custom resources whose handler is not Python (aws-cdk-lib's own Node.js singletons such as
   ``Custom::VpcRestrictDefaultSG``, which removes the default security group's rules) are recorded
   as created without running; ``<work_dir>/lambda/custom_resources.jsonl`` lists each one. Local
   mode has no network to restrict, so nothing depends on them.
2. **Stack delete runs in reverse dependency order**, as CloudFormation does (moto iterated a set,
   so the data-cleanup custom resource could run while the fleet's instances still held the
   volume). Dependencies are ``DependsOn``, ``Ref``, ``Fn::GetAtt`` and ``Fn::Sub`` references;
   moto's retry-in-another-pass behaviour is kept for what still fails.
3. **Deleting an ``AWS::EC2::SpotFleet`` cancels the request and terminates its instances**
   (CloudFormation's documented behaviour; moto's model had no delete, so the fleet and its
   instances outlived the stack).
4. **Stack delete removes what moto's models cannot delete**: ``AWS::EC2::RouteTable``,
   ``AWS::EC2::Route``, ``AWS::EC2::SubnetRouteTableAssociation``, ``AWS::EC2::InternetGateway``,
   ``AWS::EC2::VPCGatewayAttachment``, ``AWS::EC2::FlowLog`` and ``AWS::EC2::Volume`` (without
   ``DeletionPolicy: Retain``) had no delete in moto 5.2.5, so every CDK VPC failed to delete
   (``DependencyViolation``: its subnets' route tables remained) and the stack never reached
   ``DELETE_COMPLETE``.

5. **CancelSpotFleetRequests with TerminateInstances terminates every instance of the fleet**: moto
   5.2.5 terminated only the instances its own (non-maintaining) fleet launched, and failed with
   ``InvalidParameterCombination: No instances specified`` when none were left (the state after a
   spot interruption). Local mode's node runner launches replacements on the fleet's behalf and tags
   them ``aws:ec2spot:fleet-request-id`` as EC2 does, so the bridge terminates every running instance
   carrying the fleet's id, as EC2 terminates all of a fleet's instances, and skips the empty call.
   (An EC2 API bridge rather than a CloudFormation one, but it exists only for local mode's
   acting-for-the-fleet, so it lives beside bridge 3, which uses it.)
6. **``Fn::GetAtt`` of ``AWS::EFS::FileSystem``** (``Arn``, ``FileSystemId``): moto 5.2.5's model has
   no ``get_cfn_attribute``, so the DistributedTraining stack (its IAM grants name the file system's
   ARN) reached ``CREATE_COMPLETE`` and then every DescribeStackResources answered HTTP 500. And
   ``AWS::EFS::AccessPoint`` had no physical id: ``Ref`` gave the Python object's repr, which the
   node config then carried as its ``efs.access_point_id``; here ``Ref`` is the ``fsap-`` id and
   ``Fn::GetAtt`` gives ``Arn`` and ``AccessPointId``, as CloudFormation does.
7. **``AWS::CloudWatch::Alarm``**: moto 5.2 has no model for it, skipped the stack's alarms
   and then failed the deploy on the dashboard's ``Fn::GetAtt [Alarm, Arn]``; here it is created with
   PutMetricAlarm and deleted with the stack (stored, not evaluated: moto evaluates no alarm).

Nothing here is needed on AWS, and the agents never import it.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any, Callable

LOG = logging.getLogger("spot_training.local.cfn_compat")

#: Environment variable of a ``custom_resources.Provider`` framework function naming the user's handler.
PROVIDER_ON_EVENT_ENV = "USER_ON_EVENT_FUNCTION_ARN"
PROVIDER_IS_COMPLETE_ENV = "USER_IS_COMPLETE_FUNCTION_ARN"
#: Longest a handler may run when its function sets no timeout (Lambda's maximum, seconds).
MAX_HANDLER_TIMEOUT_S = 900
#: Marks the result line the handler subprocess prints (everything else it prints goes to the log).
_RESULT_MARK = "__SPOT_TRAINING_CFN_RESULT__"
FLEET_TAG = "aws:ec2spot:fleet-request-id"

_lock = threading.Lock()
_state: dict[str, Any] = {"endpoint_url": None, "work_dir": None}


class CustomResourceError(RuntimeError):
    """A custom resource's handler failed or cannot be run locally (the message says which and why)."""


def apply(*, endpoint_url: str, work_dir: str | os.PathLike[str]) -> None:
    """Apply every bridge in this (the moto server's) process. Idempotent.

    Args:
        endpoint_url: this server's own URL (``http://127.0.0.1:PORT``); handlers call AWS there.
        work_dir: directory for unpacked handler code and logs (``<work_dir>/lambda/``).

    Raises:
        ValueError: ``endpoint_url`` is not an http URL on loopback.
    """
    if not re.fullmatch(r"http://(127\.0\.0\.1|localhost|\[::1\]):\d+", str(endpoint_url)):
        raise ValueError(f"endpoint_url must be http://127.0.0.1:PORT (this moto server), got {endpoint_url!r}")
    lambda_dir = Path(work_dir) / "lambda"
    lambda_dir.mkdir(parents=True, exist_ok=True)
    with _lock:
        _state["endpoint_url"] = endpoint_url
        _state["work_dir"] = lambda_dir
        _patch_custom_resources()
        _patch_delete_order()
        _patch_spot_fleet_delete()
        _patch_ec2_deletes()
        _patch_efs_attributes()
        _patch_cloudwatch_alarms()


# --- 1: custom resources ----------------------------------------------------------------------
# The subprocess: import the handler module from the unpacked code and call it with the event.
_RUNNER = r"""
import importlib, json, sys, time, uuid
code_dir, handler_name, function_name, timeout_s, mark = sys.argv[1:6]
sys.path.insert(0, code_dir)
class Context:
    def __init__(self):
        self.function_name = function_name
        self.aws_request_id = str(uuid.uuid4())
        self._deadline = time.monotonic() + int(timeout_s)
    def get_remaining_time_in_millis(self):
        return max(0, int((self._deadline - time.monotonic()) * 1000))
module_name, _, attribute = handler_name.rpartition(".")
handler = getattr(importlib.import_module(module_name), attribute)
event = json.loads(sys.stdin.read())
result = handler(event, Context())
print(mark + json.dumps(result if result is not None else {}), flush=True)
"""


def _record(entry: dict[str, Any]) -> None:
    path = _state["work_dir"] / "custom_resources.jsonl"
    with open(path, "a", encoding="utf-8") as log:
        log.write(json.dumps({"time": time.time(), **entry}) + "\n")


def _code_dir(function: Any) -> Path:
    """Unpack the function's deployed zip once (keyed by its hash); return the directory."""
    code = bytes(function.code_bytes or b"")
    if not code:
        raise CustomResourceError(f"function {function.function_name} has no deployed code in moto (S3 asset missing?)")
    digest = hashlib.sha256(code).hexdigest()[:16]
    target = _state["work_dir"] / f"{function.function_name}-{digest}"
    if not target.is_dir():
        temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        with zipfile.ZipFile(io.BytesIO(code)) as archive:
            archive.extractall(temporary)
        os.replace(temporary, target)
    return target


def _invoke_python(function: Any, event: dict[str, Any]) -> dict[str, Any]:
    """Run a Python Lambda ``function``'s handler on ``event`` in a subprocess; return its result dict.

    Raises:
        CustomResourceError: the handler raised, timed out, or printed no result.
    """
    runtime = str(function.run_time or "")
    if not runtime.startswith("python"):
        raise CustomResourceError(f"function {function.function_name} has runtime {runtime!r}; only python runtimes run locally")
    timeout_s = min(int(function.timeout or MAX_HANDLER_TIMEOUT_S), MAX_HANDLER_TIMEOUT_S)
    region = event["ServiceToken"].split(":")[3] if event.get("ServiceToken", "").startswith("arn:") else "us-east-1"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(_state["work_dir"]),
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_REGION": region,
        "AWS_DEFAULT_REGION": region,
        "AWS_ENDPOINT_URL": _state["endpoint_url"],
        "AWS_LAMBDA_FUNCTION_NAME": function.function_name,
        "PYTHONDONTWRITEBYTECODE": "1",
        **{str(k): str(v) for k, v in (function.environment_vars or {}).items()},
    }
    log_path = _state["work_dir"] / f"{function.function_name}.log"
    started = time.monotonic()
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"--- {event['RequestType']} {event.get('LogicalResourceId')} {time.strftime('%H:%M:%S')}\n")
        log.flush()
        try:
            completed = subprocess.run(
                [sys.executable, "-c", _RUNNER, str(_code_dir(function)), str(function.handler),
                 function.function_name, str(timeout_s), _RESULT_MARK],
                input=json.dumps(event), env=env, cwd=_state["work_dir"], capture_output=True, text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired as error:
            raise CustomResourceError(f"{function.function_name} timed out after {timeout_s} s; see {log_path}") from error
        log.write(completed.stderr)
        results = [line[len(_RESULT_MARK):] for line in completed.stdout.splitlines() if line.startswith(_RESULT_MARK)]
        log.write("".join(line + "\n" for line in completed.stdout.splitlines() if not line.startswith(_RESULT_MARK)))
        log.write(f"--- exit {completed.returncode} after {time.monotonic() - started:.1f} s\n")
    if completed.returncode != 0 or not results:
        last = (completed.stderr.strip().splitlines() or ["no output"])[-1]
        raise CustomResourceError(
            f"{event['RequestType']} of {event.get('LogicalResourceId')} failed in {function.function_name}: {last} (log: {log_path})"
        )
    result = json.loads(results[-1])
    if not isinstance(result, dict):
        raise CustomResourceError(f"{function.function_name} returned {result!r}; a custom resource handler must return a dict")
    return result


def _target_function(account_id: str, region_name: str, service_token: str) -> tuple[Any | None, bool]:
    """The function that handles ``service_token`` locally: (function or None, via_provider_framework)."""
    from moto.awslambda.utils import get_backend as get_lambda_backend

    backend = get_lambda_backend(account_id, region_name)
    function = backend.get_function(service_token)
    variables = function.environment_vars or {}
    if PROVIDER_ON_EVENT_ENV in variables:
        if variables.get(PROVIDER_IS_COMPLETE_ENV):
            raise CustomResourceError(
                f"{function.function_name}: Provider with an isComplete handler is not bridged in local mode (moto 5.2.5)"
            )
        return backend.get_function(variables[PROVIDER_ON_EVENT_ENV]), True
    if str(function.run_time or "").startswith("python"):
        return function, False
    return None, False


def _run_custom_resource(resource: Any, request_type: str) -> None:
    """Send ``request_type`` (Create/Delete) for ``resource`` (a moto CustomModel) to its handler."""
    event = {
        "RequestType": request_type,
        "ServiceToken": resource._spot_service_token,
        "ResponseURL": "http://127.0.0.1/local-mode-has-no-response-url",
        "StackId": resource._spot_stack_id,
        "RequestId": str(uuid.uuid4()),
        "LogicalResourceId": resource.logical_id,
        "ResourceType": resource._spot_resource_type,
        "ResourceProperties": resource._spot_properties,
    }
    if request_type != "Create":
        event["PhysicalResourceId"] = resource.resource_name
    function, via_provider = _target_function(resource._spot_account_id, resource.region_name, resource._spot_service_token)
    if function is None:
        _record({"request": request_type, "logical_id": resource.logical_id, "type": resource._spot_resource_type,
                 "ran": False, "reason": "handler is not Python; not run in local mode"})
        LOG.warning("custom resource %s (%s): handler not run locally", resource.logical_id, resource._spot_resource_type)
        resource.set_data({})
        return
    result = _invoke_python(function, event)
    physical_id = result.get("PhysicalResourceId")
    if request_type == "Create":
        resource.resource_name = physical_id or (event["RequestId"] if via_provider else resource.resource_name)
    elif physical_id and physical_id != resource.resource_name:
        raise CustomResourceError(
            f"{request_type} of {resource.logical_id} returned PhysicalResourceId {physical_id!r}, "
            f"but a {request_type} must keep {resource.resource_name!r}"
        )
    data = result.get("Data") or {}
    _record({"request": request_type, "logical_id": resource.logical_id, "type": resource._spot_resource_type,
             "ran": True, "function": function.function_name, "physical_id": resource.resource_name, "data": data})
    resource.set_data(data)


def _patch_custom_resources() -> None:
    from moto.cloudformation.custom_model import CustomModel

    if getattr(CustomModel.create_from_cloudformation_json, "_spot_training_compat", False):
        return

    def create_from_cloudformation_json(cls, resource_name: str, cloudformation_json: dict[str, Any],
                                        account_id: str, region_name: str, **kwargs: Any) -> Any:
        from moto.cloudformation import cloudformation_backends

        properties = cloudformation_json["Properties"]
        resource = cls(region_name, str(uuid.uuid4()), kwargs["LogicalId"], resource_name)
        resource._spot_account_id = account_id
        resource._spot_stack_id = kwargs["StackId"]
        resource._spot_resource_type = kwargs["ResourceType"]
        resource._spot_service_token = properties["ServiceToken"]
        resource._spot_properties = properties
        stack = cloudformation_backends[account_id][region_name].get_stack(kwargs["StackId"])
        stack.add_custom_resource(resource)
        _run_custom_resource(resource, "Create")
        return resource

    def delete(self: Any, account_id: str, region_name: str) -> None:
        if not hasattr(self, "_spot_service_token"):
            return  # created before the bridge was applied: nothing to tell its handler
        _run_custom_resource(self, "Delete")

    create_from_cloudformation_json._spot_training_compat = True  # type: ignore[attr-defined]
    CustomModel.create_from_cloudformation_json = classmethod(create_from_cloudformation_json)  # type: ignore[method-assign]
    CustomModel.delete = delete  # type: ignore[attr-defined]


# --- 2: reverse dependency order on stack delete -----------------------------------------------
def references(value: Any, names: set[str]) -> set[str]:
    """Logical ids in ``names`` that ``value`` (a template fragment) refers to.

    Counts ``Ref``, ``Fn::GetAtt`` (list or ``"A.B"`` form) and ``${Name}`` / ``${Name.Attr}`` in
    ``Fn::Sub`` strings.
    """
    found: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "Ref" and isinstance(item, str) and item in names:
                found.add(item)
            elif key == "Fn::GetAtt":
                target = item[0] if isinstance(item, list) and item else str(item).split(".", 1)[0]
                if target in names:
                    found.add(target)
            elif key == "Fn::Sub":
                text = item[0] if isinstance(item, list) else item
                for match in re.findall(r"\$\{([A-Za-z0-9]+)(?:\.[^}]*)?\}", str(text)):
                    if match in names:
                        found.add(match)
                if isinstance(item, list) and len(item) > 1:
                    found |= references(item[1], names)
            else:
                found |= references(item, names)
    elif isinstance(value, list):
        for item in value:
            found |= references(item, names)
    return found


def deletion_order(resources: dict[str, Any]) -> list[str]:
    """Logical ids of a template's ``Resources`` in the order CloudFormation deletes them.

    Dependents before their dependencies (the reverse of a creation order); ties keep template order.
    Cycles (which CloudFormation rejects) are broken by template order rather than raising.
    """
    names = set(resources)
    depends: dict[str, set[str]] = {}
    for name, body in resources.items():
        explicit = body.get("DependsOn", [])
        explicit = [explicit] if isinstance(explicit, str) else list(explicit)
        depends[name] = ({d for d in explicit if d in names} | references(body.get("Properties", {}), names)) - {name}
    creation: list[str] = []
    done: set[str] = set()
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in done or name in visiting:
            return
        visiting.add(name)
        for dependency in sorted(depends[name], key=list(resources).index):
            visit(dependency)
        visiting.discard(name)
        done.add(name)
        creation.append(name)

    for name in resources:
        visit(name)
    return list(reversed(creation))


def _patch_delete_order() -> None:
    from moto.cloudformation.parsing import ResourceMap

    if getattr(ResourceMap.delete, "_spot_training_compat", False):
        return

    def delete(self: Any) -> None:
        # moto's own loop (passes that retry what failed while the count goes down), in CFN's order.
        order = [
            name for name in deletion_order(self._resource_json_map)
            if self._resource_json_map[name].get("DeletionPolicy") != "Retain"
        ]
        remaining = list(order)
        last_error: Exception | None = None
        previous = len(remaining) + 1
        while remaining and len(remaining) < previous:
            previous = len(remaining)
            for name in list(remaining):
                parsed = self._parsed_resources.get(name)
                try:
                    if not isinstance(parsed, str) and parsed is not None:
                        self._delete_resource(parsed, self._resource_json_map[parsed.logical_resource_id])
                        self._parsed_resources.pop(parsed.logical_resource_id)
                except Exception as error:  # noqa: BLE001 - moto's semantics: retry in the next pass
                    LOG.warning("delete of %s failed, will retry: %s", name, error)
                    last_error = error
                else:
                    remaining.remove(name)
        if remaining and last_error is not None:
            raise last_error

    delete._spot_training_compat = True  # type: ignore[attr-defined]
    ResourceMap.delete = delete  # type: ignore[method-assign]


# --- 3: spot fleet delete ----------------------------------------------------------------------
def _patch_spot_fleet_delete() -> None:
    from moto.ec2.models.spot_requests import SpotFleetRequest, SpotRequestBackend

    if not getattr(SpotRequestBackend.cancel_spot_fleet_requests, "_spot_training_compat", False):
        original = SpotRequestBackend.cancel_spot_fleet_requests

        def cancel_spot_fleet_requests(self: Any, spot_fleet_request_ids: list[str], terminate_instances: bool) -> Any:
            if not terminate_instances:
                return original(self, spot_fleet_request_ids, terminate_instances)
            cancelled = []
            for fleet_id in spot_fleet_request_ids:
                fleet = self.spot_fleet_requests.get(fleet_id)
                if fleet is None:  # already cancelled (and removed) by another caller: nothing left to do
                    continue
                fleet.target_capacity = 0
                members = {request.instance.id for request in fleet.spot_requests if request.instance is not None}
                members |= {
                    instance.id for instance in self.all_instances()
                    if self.tags.get(instance.id, {}).get(FLEET_TAG) == fleet_id
                }
                live = sorted(i for i in members if self.get_instance(i).state in ("pending", "running", "stopping", "stopped"))
                if live:  # terminate while the request still exists: moto's Instance.terminate looks it up
                    self.terminate_instances(live)
                self.spot_fleet_requests.pop(fleet_id, None)
                cancelled.append(fleet)
            return cancelled

        cancel_spot_fleet_requests._spot_training_compat = True  # type: ignore[attr-defined]
        SpotRequestBackend.cancel_spot_fleet_requests = cancel_spot_fleet_requests  # type: ignore[method-assign]

    if getattr(getattr(SpotFleetRequest, "delete", None), "_spot_training_compat", False):
        return

    def delete(self: Any, account_id: str, region_name: str) -> None:
        if self.id in self.ec2_backend.spot_fleet_requests:
            self.ec2_backend.cancel_spot_fleet_requests([self.id], terminate_instances=True)

    delete._spot_training_compat = True  # type: ignore[attr-defined]
    SpotFleetRequest.delete = delete  # type: ignore[attr-defined]


# --- 4: EC2 resources moto cannot delete from a stack -------------------------------------------
def _backend(account_id: str, region_name: str) -> Any:
    from moto.ec2.models import ec2_backends

    return ec2_backends[account_id][region_name]


def _delete_route_table(self: Any, account_id: str, region_name: str) -> None:
    backend = _backend(account_id, region_name)
    if self.id not in backend.route_tables:
        return
    for association_id in list(self._associations):
        backend.disassociate_route_table(association_id)
    backend.delete_route_table(self.id)


def _delete_route(self: Any, account_id: str, region_name: str) -> None:
    self.route_table._routes.pop(self.id, None)


def _delete_subnet_association(self: Any, account_id: str, region_name: str) -> None:
    _backend(account_id, region_name).subnet_associations.pop(f"{self.route_table_id}:{self.subnet_id}", None)


def _delete_gateway_attachment(self: Any, account_id: str, region_name: str) -> None:
    backend = _backend(account_id, region_name)
    gateway = backend.internet_gateways.get(self.gateway_id)
    if gateway is not None and gateway.vpc is not None and gateway.vpc.id == self.vpc_id:
        backend.detach_internet_gateway(self.gateway_id, self.vpc_id)


def _delete_internet_gateway(self: Any, account_id: str, region_name: str) -> None:
    backend = _backend(account_id, region_name)
    if self.id not in backend.internet_gateways:
        return
    if self.vpc is not None:
        backend.detach_internet_gateway(self.id, self.vpc.id)
    backend.delete_internet_gateway(self.id)


def _delete_flow_log(self: Any, account_id: str, region_name: str) -> None:
    backend = _backend(account_id, region_name)
    if self.id in backend.flow_logs:
        backend.delete_flow_logs([self.id])


def _delete_volume(self: Any, account_id: str, region_name: str) -> None:
    # Only reached for volumes without DeletionPolicy: Retain (ResourceMap.delete skips those).
    backend = _backend(account_id, region_name)
    if self.id in backend.volumes:
        backend.delete_volume(self.id)


def _patch_ec2_deletes() -> None:
    from moto.ec2.models.elastic_block_store import Volume
    from moto.ec2.models.flow_logs import FlowLogs
    from moto.ec2.models.internet_gateways import InternetGateway
    from moto.ec2.models.route_tables import Route, RouteTable
    from moto.ec2.models.subnets import SubnetRouteTableAssociation
    from moto.ec2.models.vpn_gateway import VPCGatewayAttachment

    for cls, function in (
        (RouteTable, _delete_route_table), (Route, _delete_route),
        (SubnetRouteTableAssociation, _delete_subnet_association), (VPCGatewayAttachment, _delete_gateway_attachment),
        (InternetGateway, _delete_internet_gateway), (FlowLogs, _delete_flow_log), (Volume, _delete_volume),
    ):
        existing = getattr(cls, "delete", None)
        if existing is None:
            function._spot_training_compat = True  # type: ignore[attr-defined]
            cls.delete = function  # type: ignore[attr-defined]
        elif not getattr(existing, "_spot_training_compat", False):
            # moto gained its own delete: keep it (and this bridge can go).
            LOG.info("moto's %s has its own delete; not patched", cls.__name__)


# --- 6: EFS attributes ------------------------------------------------------------------------
#: CloudFormation's ``Fn::GetAtt`` attributes of each EFS resource -> the moto model's attribute.
_EFS_FILE_SYSTEM_ATTRIBUTES = {"Arn": "file_system_arn", "FileSystemId": "file_system_id"}
_EFS_ACCESS_POINT_ATTRIBUTES = {"Arn": "access_point_arn", "AccessPointId": "access_point_id"}


def _get_cfn_attribute(attributes: dict[str, str]) -> Callable[[Any, str], str]:
    """A ``get_cfn_attribute`` method answering ``attributes`` (GetAtt name -> model attribute);
    any other name raises moto's ``UnformattedGetAttTemplateException`` as its own models do."""

    def get_cfn_attribute(self: Any, attribute_name: str) -> str:
        if attribute_name in attributes:
            return getattr(self, attributes[attribute_name])
        from moto.cloudformation.exceptions import UnformattedGetAttTemplateException

        raise UnformattedGetAttTemplateException()

    get_cfn_attribute._spot_training_compat = True  # type: ignore[attr-defined]
    return get_cfn_attribute


def _patch_efs_attributes() -> None:
    """moto's ``AWS::EFS::FileSystem`` has no ``Fn::GetAtt`` (``AttributeError: get_cfn_attribute``),
    which the DistributedTraining stack's IAM grants use (``FileSystem.grant_read_write`` ->
    ``Fn::GetAtt [FileSystem, Arn]``): the stack reached CREATE_COMPLETE but every
    DescribeStackResources answered HTTP 500. CloudFormation gives ``Arn`` and ``FileSystemId``."""
    from moto.efs.models import FileSystem

    existing = getattr(FileSystem, "get_cfn_attribute", None)
    if existing is None:
        FileSystem.get_cfn_attribute = _get_cfn_attribute(_EFS_FILE_SYSTEM_ATTRIBUTES)  # type: ignore[attr-defined]
        FileSystem.has_cfn_attr = classmethod(lambda cls, attr: attr in _EFS_FILE_SYSTEM_ATTRIBUTES)  # type: ignore[attr-defined]
    elif not getattr(existing, "_spot_training_compat", False):
        LOG.info("moto's EFS FileSystem has its own get_cfn_attribute; not patched")
    from moto.efs.models import AccessPoint

    # AccessPoint had neither a physical id (Ref gave the object's repr, so the node config carried
    # "<moto.efs.models.AccessPoint object at 0x...>") nor Fn::GetAtt.
    if "physical_resource_id" not in vars(AccessPoint):
        AccessPoint.physical_resource_id = property(lambda self: self.access_point_id)  # type: ignore[attr-defined]
        AccessPoint.get_cfn_attribute = _get_cfn_attribute(_EFS_ACCESS_POINT_ATTRIBUTES)  # type: ignore[attr-defined]
        AccessPoint.has_cfn_attr = classmethod(lambda cls, attr: attr in _EFS_ACCESS_POINT_ATTRIBUTES)  # type: ignore[attr-defined]


# --- 7: CloudWatch alarms in CloudFormation --------------------------------------------------------
def _alarm_model() -> type:
    """A moto CloudFormation model for ``AWS::CloudWatch::Alarm`` (moto 5.2 has none: it skipped the
    alarms with a warning, and the dashboard's ``Fn::GetAtt [Alarm, Arn]`` then failed the whole
    deploy with "references undefined resource"). Create = PutMetricAlarm with the template's
    properties (a name ``<stack>-<logical id>-<suffix>`` as CloudFormation makes one), ``Ref`` = the
    name, ``Fn::GetAtt Arn`` = the alarm ARN, delete = DeleteAlarms. moto stores alarms; it does not
    evaluate them."""
    from moto.cloudformation.exceptions import UnformattedGetAttTemplateException
    from moto.cloudwatch.models import Metric, MetricDataQuery, MetricStat, cloudwatch_backends
    from moto.cloudwatch.models import Dimension as CwDimension
    from moto.core.common_models import CloudFormationModel

    class CfnAlarm(CloudFormationModel):
        def __init__(self, alarm: Any, account_id: str, region_name: str) -> None:
            self.alarm, self.account_id, self.region_name = alarm, account_id, region_name

        @staticmethod
        def cloudformation_name_type() -> str:
            return "AlarmName"

        @staticmethod
        def cloudformation_type() -> str:
            return "AWS::CloudWatch::Alarm"

        @property
        def physical_resource_id(self) -> str:
            return self.alarm.name

        @classmethod
        def has_cfn_attr(cls, attr: str) -> bool:
            return attr == "Arn"

        def get_cfn_attribute(self, attribute_name: str) -> str:
            if attribute_name == "Arn":
                return self.alarm.alarm_arn
            raise UnformattedGetAttTemplateException()

        @classmethod
        def create_from_cloudformation_json(cls, resource_name: str, cloudformation_json: Any, account_id: str,
                                            region_name: str, **kwargs: Any) -> "CfnAlarm":
            props = cloudformation_json["Properties"]
            queries = None
            if props.get("Metrics"):
                queries = []
                for m in props["Metrics"]:
                    stat = m.get("MetricStat")
                    metric_stat = None
                    if stat:
                        dims = [CwDimension(name=d["Name"], value=d["Value"]) for d in stat["Metric"].get("Dimensions", [])]
                        metric_stat = MetricStat(metric=Metric(metric_name=stat["Metric"]["MetricName"],
                                                               namespace=stat["Metric"]["Namespace"], dimensions=dims),
                                                 period=stat.get("Period"), stat=stat.get("Stat"), unit=stat.get("Unit"))
                    queries.append(MetricDataQuery(query_id=m.get("Id"), label=m.get("Label"), period=m.get("Period"),
                                                   return_data=m.get("ReturnData"), expression=m.get("Expression"),
                                                   metric_stat=metric_stat))
            backend = cloudwatch_backends[account_id][region_name]
            alarm = backend.put_metric_alarm(
                name=props.get("AlarmName") or resource_name, namespace=props.get("Namespace"),
                metric_name=props.get("MetricName"), comparison_operator=props["ComparisonOperator"],
                evaluation_periods=int(props["EvaluationPeriods"]), period=props.get("Period"),
                threshold=float(props["Threshold"]) if props.get("Threshold") is not None else None,
                statistic=props.get("Statistic"), description=props.get("AlarmDescription", ""),
                dimensions=props.get("Dimensions", []), alarm_actions=props.get("AlarmActions", []),
                metric_data_queries=queries,
                datapoints_to_alarm=int(props["DatapointsToAlarm"]) if props.get("DatapointsToAlarm") else None,
                ok_actions=props.get("OKActions", []), insufficient_data_actions=props.get("InsufficientDataActions", []),
                treat_missing_data=props.get("TreatMissingData"))
            return cls(alarm, account_id, region_name)

        @classmethod
        def delete_from_cloudformation_json(cls, resource_name: str, cloudformation_json: Any, account_id: str,
                                            region_name: str) -> None:
            cloudwatch_backends[account_id][region_name].delete_alarms([resource_name])

        def delete(self, account_id: str, region_name: str) -> None:
            cloudwatch_backends[account_id][region_name].delete_alarms([self.alarm.name])

    return CfnAlarm


def _patch_cloudwatch_alarms() -> None:
    from moto.cloudformation import parsing

    if "AWS::CloudWatch::Alarm" in parsing.get_model_map():
        LOG.info("AWS::CloudWatch::Alarm already has a CloudFormation model (moto or an earlier apply); not patched")
        return
    _alarm_model()
    for cached in (parsing.get_model_list, parsing.get_model_map, parsing.get_name_type_map):
        cached.cache_clear()

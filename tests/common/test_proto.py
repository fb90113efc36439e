"""The committed generated code must equal a fresh generation from proto/."""

from pathlib import Path

from cli.protogen import ROOT, generate


def test_committed_generated_code_matches_fresh_generation(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert len(fresh) == 21
    for path in fresh:
        relative = path.relative_to(tmp_path)
        committed = ROOT / relative
        assert committed.exists(), f"{relative} is not committed; run `make proto`"
        assert committed.read_text() == path.read_text(), (
            f"{relative} differs from proto/; run `make proto` and commit the result"
        )


def test_v2_service_matches_the_spec_names() -> None:
    from common.gen.inference import grpc_service_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == "inference.GRPCInferenceService"
    assert [m.name for m in service.methods] == [
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelStreamInfer",
    ]
    fields = {f.name: f.number for f in pb.ModelInferRequest.DESCRIPTOR.fields}
    assert fields == {
        "model_name": 1,
        "model_version": 2,
        "id": 3,
        "parameters": 4,
        "inputs": 5,
        "outputs": 6,
        "raw_input_contents": 7,
    }
    stream = {f.name: f.number for f in pb.ModelStreamInferResponse.DESCRIPTOR.fields}
    assert stream == {"error_message": 1, "infer_response": 2}


def test_ext_proc_matches_envoys_names_and_numbers() -> None:
    """Envoy reads these as its own messages: the service path and the numbers of every
    field the endpoint picker uses are Envoy's (envoyproxy/data-plane-api)."""
    from common.gen.envoy.config.core.v3 import base_pb2
    from common.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    service = ep.DESCRIPTOR.services_by_name["ExternalProcessor"]
    assert service.full_name == "envoy.service.ext_proc.v3.ExternalProcessor"
    assert [(m.name, m.client_streaming, m.server_streaming) for m in service.methods] == [
        ("Process", True, True)
    ]

    def numbers(message: type) -> dict[str, int]:
        return {f.name: f.number for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]

    assert numbers(ep.ProcessingRequest) == {
        "request_headers": 2,
        "response_headers": 3,
        "request_body": 4,
        "response_body": 5,
        "request_trailers": 6,
        "response_trailers": 7,
        "metadata_context": 8,
        "attributes": 9,
        "observability_mode": 10,
        "protocol_config": 11,
    }
    assert numbers(ep.ProcessingResponse) == {
        "request_headers": 1,
        "response_headers": 2,
        "request_body": 3,
        "response_body": 4,
        "request_trailers": 5,
        "response_trailers": 6,
        "immediate_response": 7,
        "dynamic_metadata": 8,
        "mode_override": 9,
        "override_message_timeout": 10,
        "request_drain": 11,
    }
    assert numbers(ep.ImmediateResponse) == {
        "status": 1,
        "headers": 2,
        "body": 3,
        "grpc_status": 4,
        "details": 5,
    }
    assert numbers(base_pb2.HeaderValue) == {"key": 1, "value": 2, "raw_value": 3}
    assert numbers(base_pb2.HeaderValueOption) == {
        "header": 1,
        "append": 2,
        "append_action": 3,
        "keep_empty_value": 4,
    }

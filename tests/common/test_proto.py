"""The committed generated code must equal a fresh generation from proto/."""

from pathlib import Path

from cli.protogen import ROOT, generate


def test_committed_generated_code_matches_fresh_generation(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert len(fresh) == 9
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

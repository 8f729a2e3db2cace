"""iDLG reads the answer tokens out of USL's gradient at CB and out of FL adapter updates."""

import copy

import torch
from peft import get_peft_model_state_dict

from attacks import Recorder, Recording, build_attack
from attacks.truth import StaticTruth
from vlm.lora import lora_parameters
from vlm.segments import (
    merge_multimodal_inputs,
    next_token_loss,
    project_visual_features,
    run_decoder_layers,
)
from wire import pack_rows, unpack_rows


def record_usl_steps(folder, knowledge, client_activation, samples, batch_size, corrupt=None):
    """One USL step per batch as the server sees it: activation at CA (up), the body's rows at CB
    (down, which the server computed), and the tail's gradient at CB (up)."""
    model, (cut_a, cut_b) = knowledge.model, knowledge.cuts
    recorder = Recorder(folder, header={"config": {"paradigm": "usl", "pruning.policy": "off"}})
    samples_by_seq = {}
    for start in range(0, len(samples), batch_size):
        batch = samples[start : start + batch_size]
        sent = client_activation(knowledge, model, batch)
        first = recorder.record(1, 1, "activation at CA", sent)
        hidden, mask, positions = unpack_rows(sent["rows"], sent["lengths"])
        with torch.no_grad():
            body = run_decoder_layers(model, hidden, mask, positions, cut_a, cut_b)
        rows = pack_rows(body, mask)[0].requires_grad_()
        recorder.record(1, 1, "activation at CB", {"rows": rows.detach()}, direction="down")
        # The client's tail: its loss over the answer tokens, and the gradient it returns.
        features = knowledge.features(knowledge.pixel_values(batch))
        visual = [project_visual_features(model, f.unsqueeze(0))[0] for f in features]
        labels = merge_multimodal_inputs(model, [knowledge.prompt_ids(s.question) for s in batch], visual,
                                         [knowledge.answer_ids(s.answer) for s in batch]).labels
        tail_in, mask, positions = unpack_rows(rows, sent["lengths"])
        logits = run_decoder_layers(model, tail_in, mask, positions, cut_b, knowledge.num_layers, apply_head=True)
        next_token_loss(logits, labels).backward()
        grad = rows.grad if corrupt is None else corrupt(rows.grad)
        recorder.record(1, 1, "gradient at CB", {"grad": grad})
        samples_by_seq[first.seq + 2] = list(batch)
    return Recording.open(folder), StaticTruth(samples_by_seq)


def test_idlg_recovers_every_answer_from_the_gradient_at_cb_at_batch_size_1(knowledge, client_activation, victims, aux, tmp_path):
    recording, truth = record_usl_steps(tmp_path / "rec", knowledge, client_activation, victims[:12], batch_size=1)
    result = build_attack("idlg", knowledge, matching_iterations=100, progress=False).fit(aux).run(recording, truth)
    print(result.metrics)
    assert result.metrics["label_accuracy"] == 1.0
    assert result.metrics["baseline_label_accuracy"] < 0.7


def test_idlg_recovers_answers_from_a_batch(knowledge, client_activation, victims, aux, tmp_path):
    recording, truth = record_usl_steps(tmp_path / "rec", knowledge, client_activation, victims[:16], batch_size=4)
    result = build_attack("idlg", knowledge, matching_iterations=100, progress=False).fit(aux).run(recording, truth)
    print(result.metrics)
    assert result.metrics["label_accuracy"] > 0.9


def test_idlg_fails_on_a_gradient_without_the_labels(knowledge, client_activation, victims, aux, tmp_path):
    def noise(grad):
        return torch.randn(grad.shape, generator=torch.Generator().manual_seed(0)) * grad.std()

    recording, truth = record_usl_steps(tmp_path / "rec", knowledge, client_activation, victims[:12], batch_size=1, corrupt=noise)
    result = build_attack("idlg", knowledge, matching_iterations=100, progress=False).fit(aux).run(recording, truth)
    print(result.metrics)
    assert result.metrics["label_accuracy"] < 0.3


def record_fl_updates(folder, knowledge, samples, batch_size, lr=1e-3):
    """One FL round per batch: a client's adapters after one AdamW step from the global ones."""
    recorder = Recorder(folder, header={"config": {"paradigm": "fl"}})
    samples_by_seq = {}
    for start in range(0, len(samples), batch_size):
        batch = samples[start : start + batch_size]
        client = copy.deepcopy(knowledge.model)
        optimizer = torch.optim.AdamW(lora_parameters(client).values(), lr=lr, weight_decay=0.0)
        features = knowledge.features(knowledge.pixel_values(batch))
        visual = [project_visual_features(client, f.unsqueeze(0))[0] for f in features]
        inputs = merge_multimodal_inputs(client, [knowledge.prompt_ids(s.question) for s in batch], visual,
                                         [knowledge.answer_ids(s.answer) for s in batch])
        logits = run_decoder_layers(client, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0,
                                    knowledge.num_layers, apply_head=True)
        next_token_loss(logits, inputs.labels).backward()
        optimizer.step()
        entry = recorder.record(1, start + 1, "adapter update", get_peft_model_state_dict(client))
        samples_by_seq[entry.seq] = list(batch)
    return Recording.open(folder), StaticTruth(samples_by_seq)


def test_idlg_recovers_the_answer_from_an_fl_update_at_batch_size_1(knowledge, victims, aux, tmp_path):
    recording, truth = record_fl_updates(tmp_path / "rec", knowledge, victims[:12], batch_size=1)
    result = build_attack("idlg", knowledge, matching_iterations=100, progress=False).fit(aux).run(recording, truth)
    print(result.metrics, result.details)
    assert result.metrics["top1_label_accuracy"] == 1.0


def test_idlg_guesses_at_chance_when_the_update_is_noise(knowledge, victims, aux, tmp_path):
    recording, truth = record_fl_updates(tmp_path / "rec", knowledge, victims[:12], batch_size=1)
    generator = torch.Generator().manual_seed(0)
    noisy = Recorder(tmp_path / "noisy", header=recording.header)
    for entry in recording.select("adapter update"):
        update = recording.tensors(entry)
        noisy.record(entry.round, entry.client, entry.kind,
                     {key: torch.randn(value.shape, generator=generator) * 1e-3 for key, value in update.items()})
    result = build_attack("idlg", knowledge, matching_iterations=100, progress=False).fit(aux).run(Recording.open(tmp_path / "noisy"), truth)
    print(result.metrics)
    assert result.metrics["top1_label_accuracy"] < 0.4

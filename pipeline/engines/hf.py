"""The transformers engine: batched generation and hidden-state capture for any causal LM."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.engines import DEFAULT_TEACHER, Capture, Generation, SamplingParams, TeacherRequest
from pipeline.engines.layer_ids import hf_hidden_states_indices
from pipeline.engines.target import load_model, load_tokenizer


class HFEngine:
    name = "hf"

    def __init__(self, model_dir: Path, dtype: str = "float32", trust_remote_code: bool = False):
        import transformers

        self.version = f"transformers-{transformers.__version__}"
        self.model = load_model(model_dir, dtype, trust_remote_code)
        self.tokenizer = load_tokenizer(model_dir, trust_remote_code)
        self.num_layers = int(self.model.config.get_text_config().num_hidden_layers)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_id = self.tokenizer.eos_token_id

    def _padded(self, sequences: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            span = slice(width - len(seq), width) if left else slice(0, len(seq))
            ids[row, span] = torch.tensor(seq, dtype=torch.long)
            mask[row, span] = 1
        return ids, mask

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        ids, mask = self._padded(prompts, left=True)
        sampling = params.temperature > 1e-6
        torch.manual_seed(params.seed)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=params.max_new_tokens,
            do_sample=sampling,
            temperature=params.temperature if sampling else None,
            top_p=None,
            top_k=None,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_logits=params.top_logprobs > 0,
        )
        top = None
        if params.top_logprobs:  # raw logits of every step -> [batch, steps, k]
            values, indices = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).topk(
                params.top_logprobs, -1
            )
            top = torch.stack([indices.float(), values], -1).tolist()
        results = []
        for index, row in enumerate(out.sequences[:, ids.shape[1] :].tolist()):
            length = row.index(self.eos_id) + 1 if self.eos_id in row else len(row)
            results.append(
                Generation(
                    row[:length],
                    "stop" if self.eos_id in row else "length",
                    [[[int(i), v] for i, v in step] for step in top[index][:length]] if top else None,
                )
            )
        return results

    @torch.no_grad()
    def capture(
        self, sequences: list[list[int]], aux_layer_ids: list[int], teacher: TeacherRequest = DEFAULT_TEACHER
    ) -> list[Capture]:
        # hidden_states[k + 1] is the output of decoder layer k; hidden_states[N] is the final-norm output.
        # Only layers an engine can capture for a drafter are asked for (pipeline.engines.layer_ids).
        wanted = hf_hidden_states_indices(aux_layer_ids, self.num_layers) + [self.num_layers]
        ids, mask = self._padded(sequences, left=False)
        out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=wanted, use_cache=False)
        states = out.hidden_states
        aux = torch.cat([states[i] for i in wanted[:-1]], dim=-1)
        last = states[self.num_layers] if "last_hidden" in teacher.kinds else None
        top_values = top_ids = None
        if "topk" in teacher.kinds:
            top_values, top_ids = torch.log_softmax(out.logits.float(), dim=-1).topk(teacher.topk, dim=-1)
        captures = []
        for row, seq in enumerate(sequences):
            n = len(seq)
            captures.append(
                Capture(
                    aux[row, :n].clone(),
                    last[row, :n].clone() if last is not None else None,
                    top_ids[row, :n].clone() if top_ids is not None else None,
                    top_values[row, :n].clone() if top_values is not None else None,
                )
            )
        return captures

"""Generate a tiny random-weight Llama model + WordLevel tokenizer for a real vLLM on CPU.

    .vllm-venv/bin/python bench/vllm_cpu/make_tiny_model.py --out .vllm-model

Nothing is downloaded: the weights are random (seeded), the tokenizer is built here from
a small English word list with `tokenizers`, wrapped in `PreTrainedTokenizerFast` with a
jinja chat template so `/v1/chat/completions` works. The output directory holds
`config.json`, `model.safetensors`, `generation_config.json`, `tokenizer.json` (usable by
kvgate for exact token counts), `tokenizer_config.json` (with the chat template, which
kvgate renders to count chat prompts) and `special_tokens_map.json`.

Shape: hidden 128, 2 layers, 2 attention heads, 1 KV head -> head_dim 64 (the CPU
attention kernel rejects head_dim 16). KV bytes/token in float32 =
2 (K,V) x 2 layers x 1 kv head x 64 x 4 bytes = 1024 B.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
PUNCTUATION = [*".,!?;:'\"()-[]{}/\\*+=<>@#$%&_|~`^", "...", "'s", "n't"]
WORDS = """
the be to of and a in that have i it for not on with he as you do at this but his by from
they we say her she or an will my one all would there their what so up out if about who
get which go me when make can like time no just him know take people into year your good
some could them see other than then now look only come its over think also back after use
two how our work first well way even new want because any these give day most us is are
was were been has had did does said made went got took came saw knew thought told asked
hello hi yes thanks thank please sorry okay ok sure great nice fine bad big small long short
high low old young right left wrong true false same different next last early late few many
much more less little own other such each every both either neither all another enough
world life hand part child eye woman man place week case point government company number
group problem fact home water room mother father money story month night lot book word
side kind head house service friend power hour game line end member law car city name team
minute idea kid body information school face others level office door health person art war
history party result change morning reason research girl guy moment air teacher force
education food question answer system computer model data request token tokens server
cache memory queue priority tenant limit rate user assistant message chat text prompt
reply test one two three four five six seven eight nine ten hundred thousand million
red blue green black white yellow color light dark sun moon star sky sea river tree
dog cat bird fish horse cow animal apple bread milk coffee tea
run walk talk read write speak listen open close start stop begin end help need try call
keep let put mean become leave feel seem turn show hear play move live believe hold bring
happen provide sit stand lose pay meet include continue set learn lead understand watch
follow create spend grow offer remember love consider appear buy wait serve die send
expect build stay fall cut reach kill remain suggest raise pass sell require report decide
pull explain why where here very really always never often sometimes again still already
today tomorrow yesterday soon later before during while until since through between
under above below near far around across against among without within along behind
quick quickly slow slowly fast easy hard simple important possible free full empty
""".split()  # noqa: SIM905


def build_vocab() -> dict[str, int]:
    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS + PUNCTUATION + [str(d) for d in range(10)] + WORDS:
        if tok not in vocab:
            vocab[tok] = len(vocab)
    return vocab


CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% else %}{% set content = message['content'] | map(attribute='text') | join(' ') %}"
    "{% endif %}"
    "{{ message['role'] }} : {{ content }} {{ eos_token }} "
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def build_tokenizer(max_len: int):
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    vocab = build_vocab()
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # completions prompts get a BOS, like a Llama tokenizer; chat prompts carry it in the
    # template and are encoded with add_special_tokens=False by vLLM.
    tok.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def pin_chat_template(out: Path) -> None:
    """Keep the chat template in ``tokenizer_config.json`` too: newer transformers save it to
    ``chat_template.jinja`` only. kvgate reads either (its exact chat counts render it), and
    vLLM (transformers) prefers the ``.jinja`` file, which holds the same template."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if config.get("chat_template") != CHAT_TEMPLATE:
        config["chat_template"] = CHAT_TEMPLATE
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".vllm-model")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(args.max_len)
    vocab_size = len(tokenizer)

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_len,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    pin_chat_template(out)

    n_params = sum(p.numel() for p in model.parameters())
    info = {
        "out": str(out),
        "vocab_size": vocab_size,
        "params": n_params,
        "head_dim": args.hidden // args.heads,
        "kv_bytes_per_token_fp32": 2
        * args.layers
        * args.kv_heads
        * (args.hidden // args.heads)
        * 4,
        "files": sorted(p.name for p in out.iterdir()),
    }
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()

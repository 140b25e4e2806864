"""How llama.cpp splits a text before byte-level BPE, by `tokenizer.ggml.pre`.

Each pre-tokenizer is a list of regexes applied in turn: every regex cuts each piece the
previous ones left into its matches and the stretches between them (`tokenizers`' Split,
"isolated"). The regexes are the models' own (their tokenizer.json pre-tokenizers), in the form
llama.cpp's vocabulary code (src/llama-vocab.cpp, llm_tokenizer_bpe) runs them: case-insensitive
contractions spelled out as classes (`'[sS]`), `$` as the end of the piece (`\\z`).

A name also carries llama.cpp's per-model switches that change ids: `ignore_merges` (a piece that
is a token whole is that token, without merging) and `add_bos` (BOS first, unless the file's
tokenizer.ggml.add_bos_token says otherwise). Its `clean_spaces` only tidies llama.cpp's own
detokenized text and is not reproduced: decoding gives the text back.

Names llama.cpp knows but runs through code of its own rather than a regex (kimi-k2's Han
handling, afmoe's digit grouping, superbpe's empty-match digit split) or over raw UTF-8 with
spaces as U+2581 instead of GPT-2's byte alphabet (gemma4, sarvam-moe, whitespace) are REFUSED.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_CONTRACTIONS = r"'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]"
_WHITESPACE = r"|\s*[\r\n]+|\s+(?!\S)|\s+"
# GPT-2's own: contractions, letters, digits, other symbols, each with at most one space before.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"


def _llama3_like(digits: str) -> str:
    """Llama 3's: a letter run takes one non-letter before it; digits as `digits`; newlines kept together."""
    return rf"(?:{_CONTRACTIONS})|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|{digits}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*" + _WHITESPACE


# Words of an upper-case run and a lower-case tail, cut at each case change (GPT-4o's, Tekken's).
_CASED = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
          r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*")
_CASED_CONTRACTED = (rf"[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}])([^a-z]))*((?=[\p{{L}}])([^A-Z]))+(?:{_CONTRACTIONS})?"
                     rf"|[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}])([^a-z]))+((?=[\p{{L}}])([^A-Z]))*(?:{_CONTRACTIONS})?")
_CASED_MARKS = _CASED_CONTRACTED.replace(r"(?=[\p{L}])", r"(?=[\p{L}\p{M}])")
# The models' own cased words, in Unicode letter classes; llama.cpp's regex sees top-level categories
# only and reads \p{Lu}, \p{Ll}, \p{Lt}, \p{Lm} and \p{Lo} each as \p{L}, so "camelCase" stays one word.
_UNICODE_CASED = re.sub(r"\\p\{L[ultmo]\}", r"\\p{L}", (
    rf"[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}]*[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}]+"
    rf"(?:{_CONTRACTIONS})?|[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}]+"
    rf"[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}]*(?:{_CONTRACTIONS})?"))
_ASCII_PUNCTUATION = r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]"""
# Non-ASCII classes written as escapes: a class is code points, which an editor must not normalize.
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_LATIN_GREEK_CYRILLIC = r"\s?" + (
    "[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-"
    "\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-"
    "\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-"
    "\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e"
    "\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-"
    "\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-"
    "\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943") + "]+"
_DEEPSEEK_V3 = (rf"{_ASCII_PUNCTUATION}[A-Za-z]+|[^\r\n\p{{L}}\p{{P}}\p{{S}}]?[\p{{L}}\p{{M}}]+"
                r"| ?[\p{P}\p{S}]+[\r\n]*" + _WHITESPACE)
_BLOOM = r" ?[^(\s|.,!?" + "\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

# family -> its regexes, in the order llama.cpp applies them
FAMILIES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "llama3": (_llama3_like(r"\p{N}{1,3}"),),
    "qwen2": (_llama3_like(r"\p{N}"),),
    "minicpm5": (r"\p{N}{1,3}", _llama3_like(r"\p{N}+")),
    "jais2": (rf"(?:{_CONTRACTIONS})|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*"
              r"|\s*[\r\n]+" + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
              + r"|\s{1,2}(?!\S)|\s{1}",),
    "qwen35": (rf"(?:{_CONTRACTIONS})|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+|\p{{N}}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*" + _WHITESPACE,),
    "deepseek-llm": (r"[\r\n]", _LATIN_GREEK_CYRILLIC, r"\s?[!-/:-~" + "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                     r"\s+\z", _CJK_HANGUL, r"\p{N}+"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"),
    "deepseek-v3": (r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK_V3),
    "spark2_5": (r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK_V3.replace(r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+",
                                                                r"| ?[\p{P}\p{S}]+|[\r\n]"), r"\p{N}"),
    "youtu": ("[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c"
              "\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _CJK_KANA,
              _UNICODE_CASED + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _WHITESPACE),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "starcoder": (r"\p{N}", _GPT2),
    "bloom": (_BLOOM,),
    "viking": (_BLOOM, r"\p{N}"),
    "tekken": (_CASED + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _WHITESPACE,),
    "gpt-4o": (_CASED_CONTRACTED + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _WHITESPACE,),
    "granite-embed-multi-97m": (_CASED_MARKS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _WHITESPACE,),
    "tiny_aya": (r"\d{1,3}(?=(?:\d{3})*\b)", _UNICODE_CASED + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _WHITESPACE),
    "chameleon": (r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
                  r"[\p{P}!-/:-@\[-`{-~]", _GPT2),
    "bailingmoe": (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",),
    "seed-coder": (rf"(?:{_CONTRACTIONS})|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1}}| ?[^\s\p{{L}}\p{{N}}\r\n]+"
                   + _WHITESPACE,),
    "ufakzeka": (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _WHITESPACE,),
    "laguna": (r"[^\n]+|[\n]+", _llama3_like(r"\p{N}")),
    "exaone-moe": (rf"(?:{_CONTRACTIONS})|[^\r\n\p{{L}}\p{{N}}]?(?:\p{{L}}\p{{M}}*(?: \p{{L}}\p{{M}}*)*)+|\p{{N}}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",),
}


@dataclass(frozen=True)
class PreTokenizer:
    family: str
    ignore_merges: bool = False
    add_bos: bool = False


def _named(family: str, names: str, **switches: bool) -> dict[str, PreTokenizer]:
    return {name: PreTokenizer(family, **switches) for name in names.split()}


# tokenizer.ggml.pre -> how llama.cpp splits for it (a file without the key: "default")
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_named("default", "default"),
    **_named("minicpm5", "minicpm5", ignore_merges=True),
    **_named("llama3", "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
             ignore_merges=True, add_bos=True),
    **_named("llama3", "dbrx smaug-bpe chatglm-bpe"),
    **_named("llama3", "glm4 glm5", ignore_merges=True),
    **_named("jais2", "jais-2"),
    **_named("deepseek-llm", "deepseek-llm"),
    **_named("deepseek-coder", "deepseek-coder"),
    **_named("deepseek-v3", "deepseek-v3 hunyuan-dense hy_v4 joyai-llm"),
    **_named("spark2_5", "spark2_5"),
    **_named("youtu", "youtu", ignore_merges=True),
    **_named("falcon", "falcon"),
    **_named("starcoder", "starcoder refact command-r smollm codeshell exaone minerva-7b mellum2"),
    **_named("gpt2", "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert "
                     "jina-v1-en jina-v2-code roberta-bpe exaone4 mpt olmo jais trillion granite-docling"),
    **_named("qwen2", "qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2"),
    **_named("qwen35", "qwen35"),
    **_named("bloom", "poro-chat bloom gpt3-finnish"),
    **_named("viking", "viking"),
    **_named("tekken", "tekken", ignore_merges=True, add_bos=True),
    **_named("chameleon", "chameleon", add_bos=True),
    **_named("gpt-4o", "gpt-4o llama4 kanana2 talkie minimax-m2"),
    **_named("granite-embed-multi-97m", "granite-embed-multi-97m", ignore_merges=True),
    **_named("tiny_aya", "tiny_aya cohere2moe"),
    **_named("bailingmoe", "bailingmoe bailingmoe2 llada-moe"),
    **_named("seed-coder", "seed-coder"),
    **_named("ufakzeka", "ufakzeka"),
    **_named("laguna", "laguna"),
    **_named("exaone-moe", "exaone-moe"),
}
REFUSED = ("kimi-k2", "afmoe", "superbpe", "gemma4", "granite-embed-multi-311m", "sarvam-moe", "whitespace")

"""The model's chat template (Jinja, from its GGUF / tokenizer config, kept in the manifest),
rendered in a sandbox as Hugging Face's tokenizers do: `qwc run --chat`, `qwc serve`'s
/v1/chat/completions and `qwc lora`'s chat data share it."""

from __future__ import annotations

from .errors import QwcError


class ChatTemplate:
    def __init__(self, source: str | None):
        if not source:
            raise QwcError("this model has no chat template")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):   # templates call it on bad conversations (HF's convention)
            raise jinja2.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise QwcError(f"the model's chat template does not parse ({e})") from None
        self._error = jinja2.TemplateError
        # does the template render tools itself (Qwen2.5's does; runtime/tools.py otherwise)
        self.knows_tools = "tools" in source and "tool_call" in source

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
               **variables) -> str:
        """`variables`: the template's own switches (Qwen3's enable_thinking: OpenAI clients send
        them as chat_template_kwargs, as vLLM and llama-server take them)."""
        try:
            return self._template.render(**variables, messages=messages, add_generation_prompt=add_generation_prompt,
                                         **({"tools": tools} if tools else {}))
        except self._error as e:
            raise QwcError(f"the model's chat template fails on these messages ({e})") from None

"""Tiny vision-language models for the family tests, each built once per test module."""

from __future__ import annotations


def tiny_vlm_getter(tmp_path_factory):
    """``get(model_type)``: (directory, model, processor, loaded VLM) of the family's tiny
    model (tfgraph/tools/tiny_vlm_build.py), built and loaded at the random image's size on
    first use."""
    from tfgraph.sources.vision_language import load_vision_language
    from tfgraph.tools.tiny_vlm_build import IMAGE_HW, build_family
    from tfgraph.tools.tiny_vlm_families import spec_for

    built: dict = {}

    def get(model_type: str):
        if model_type not in built:
            directory = tmp_path_factory.mktemp(model_type) / "hf"
            model, processor = build_family(model_type, directory, spec_for(model_type))
            vlm = load_vision_language(directory, image_size=IMAGE_HW)
            built[model_type] = directory, model, processor, vlm
        return built[model_type]

    return get

"""Image prompts for vision-language models: images from dataset rows, processor inputs per prompt, positions."""

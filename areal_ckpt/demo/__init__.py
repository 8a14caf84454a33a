"""The demo job (`make demo`) and the tiny model / tokenizer builders it and the tests share."""

"""A self-distillation corpus from a JSONL file of prompts: the target answers each one greedily.

``python -m flashmm.train`` builds it under ``--out/corpus/`` before training a text drafter, in
flashmm.train.corpus's format (corpus.jsonl.xz + build_info.json), so every trainer reads the
target's own answers (its greedy tokens, never re-tokenised text). A prompt file line is one of

    {"prompt": "Write a haiku."}                                     one user turn
    {"turns": ["Write a haiku.", "Now one about snow."]}             Spec-Bench's layout: each turn is
                                                                     asked after the target's answer
                                                                     to the previous ones
    {"messages": [{"role": "system", "content": ...}, {"role": "user", "content": ...}, ...]}
                                                                     a chat, answered at its last turn

Each answered user turn becomes one CorpusRecord (prompt_ids: the chat template rendered around the
conversation so far, ending with the assistant header). Answers are appended to
``corpus/answers.jsonl`` as they are written, so a killed run continues where it stopped; once all
are written the corpus is packed, and later runs read it without running the target.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch

from .corpus import CORPUS_FILE, Answer, CorpusRecord, read_corpus, read_info, write_corpus
from .data_parallel import ONE_PROCESS, DataParallel

ANSWERS_FILE = "answers.jsonl"
ANSWERS_GLOB = "answers*.jsonl"  # answers.jsonl, or answers.<process>.jsonl under a launch


def read_prompts(path) -> list[list[dict]]:
    """The conversations of a prompt file: per line, chat messages ending with a user turn, or (for
    "turns") the user turns alone, answered one after another. Errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {str(path)!r}: no such file (a JSONL file of prompts)")
    conversations = []
    with path.open() as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"--data {path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err})") from err
            conversations.append(_conversation(row, where))
    if not conversations:
        raise ValueError(f"--data {path}: holds no prompts")
    return conversations


def _conversation(row, where: str) -> list[dict]:
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    if isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"] \
            and all(isinstance(t, str) for t in row["turns"]):
        return [{"role": "user", "content": t} for t in row["turns"]]
    if isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"] and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in row["messages"]):
        if row["messages"][-1]["role"] != "user":
            raise ValueError(f'{where}: "messages" must end with a user turn (the one the target answers)')
        return [dict(role=m["role"], content=m["content"]) for m in row["messages"]]
    raise ValueError(f'{where}: each line needs "prompt": str, "turns": [str, ...] or '
                     '"messages": [{"role": ..., "content": ...}, ...]')


def stop_ids(model, tokenizer) -> set[int]:
    """Token ids that end an answer: the generation config's and tokenizer's end-of-sequence ids, and
    ``<|im_end|>`` where the tokenizer has it."""
    ids = {tokenizer.eos_token_id}
    eos = model.generation_config.eos_token_id
    ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end, int) and end != tokenizer.unk_token_id:
        ids.add(end)
    return {i for i in ids if i is not None}


def render(tokenizer, messages: list[dict], where: str) -> list[int]:
    """Token ids of ``messages`` ready for the assistant's answer: the chat template when the
    tokenizer has one, else a single user turn's text as the tokenizer encodes it."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    if len(messages) != 1:
        raise ValueError(f"{where}: a conversation of {len(messages)} messages needs a chat template, and the "
                         "target's tokenizer has none; give one \"prompt\" per line")
    return tokenizer.encode(messages[0]["content"])


@torch.no_grad()
def greedy_answer(model, prompt_ids: list[int], max_new_tokens: int, stops: set[int]) -> tuple[list[int], bool]:
    """The target's greedy continuation of ``prompt_ids`` (without its stop token) and whether a stop
    token ended it (False: cut at ``max_new_tokens``)."""
    device = model.get_output_embeddings().weight.device
    ids = torch.tensor([prompt_ids], device=device)
    pad = model.generation_config.pad_token_id
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=sorted(stops) or None, pad_token_id=pad if pad is not None else 0)
    new = out[0, len(prompt_ids):].tolist()
    for i, token in enumerate(new):
        if token in stops:
            return new[:i], True
    return new, False


def _settings(conversations: list[list[dict]], max_new_tokens: int, target: str) -> dict:
    digest = hashlib.sha256(json.dumps(conversations, sort_keys=True).encode()).hexdigest()[:16]
    return {"prompts_sha256": digest, "conversations": len(conversations), "max_new_tokens": max_new_tokens,
            "target": target}


def build_self_corpus(model, tokenizer, conversations: list[list[dict]], folder, *, max_new_tokens: int,
                      target: str, log=print, parallel: DataParallel = ONE_PROCESS) -> list[CorpusRecord]:
    """The corpus of ``conversations`` answered by ``model`` (see the module docstring), cached in
    ``folder``: a finished corpus is read back; an unfinished one continues from its answers files.
    A folder built from other prompts, another target or another ``max_new_tokens`` is refused.

    Under a launch of P processes (``parallel``) process r answers the conversations i with i % P == r
    into its own answers file; process 0 then packs every answer, in order, into the corpus the others
    read. Greedy answers do not depend on which process writes them: the corpus is a single process's."""
    folder = Path(folder)
    settings = _settings(conversations, max_new_tokens, target)
    if (folder / CORPUS_FILE).is_file():
        before = read_info(folder).get("settings")
        if before != settings:
            raise ValueError(f"{folder} holds a corpus of other prompts or settings ({before}, now {settings}); "
                             "use another --out, or delete that folder to rebuild it")
        log(f"corpus: reading {folder / CORPUS_FILE} (built before)")
        return read_corpus(folder)
    folder.mkdir(parents=True, exist_ok=True)
    done = {}
    for path in sorted(folder.glob(ANSWERS_GLOB)):  # every earlier run's answers, whichever process wrote them
        done.update(_read_answers(path, settings, repair=False))
    parallel.barrier()  # every process has read them before any writes
    own = folder / (ANSWERS_FILE if parallel.processes == 1 else f"answers.{parallel.rank}.jsonl")
    _read_answers(own, settings)  # its own torn last line, if a kill left one, is dropped
    stops = stop_ids(model, tokenizer)
    mine = range(parallel.rank, len(conversations), parallel.processes)
    with own.open("a") as fh:
        if fh.tell() == 0:  # a new file: its first line says what it answers
            fh.write(json.dumps({"settings": settings}) + "\n")

        def answer(key: str, prompt_ids: list[int]) -> dict:
            ids, finished = greedy_answer(model, prompt_ids, max_new_tokens, stops)
            done[key] = {"key": key, "prompt_ids": prompt_ids, "ids": ids, "finished": finished}
            fh.write(json.dumps(done[key]) + "\n")
            fh.flush()
            return done[key]

        for count, index in enumerate(mine, 1):
            for _ in _conversation_records(index, conversations[index], done, tokenizer, answer):
                pass
            if count % 20 == 0 or count == len(mine):
                log(f"corpus: {count}/{len(mine)} conversations answered"
                    + (f" (process {parallel.rank} of {parallel.processes})" if parallel.processes > 1 else ""))
    parallel.barrier()  # every answer is written
    if parallel.is_main:
        for path in sorted(folder.glob(ANSWERS_GLOB)):
            done.update(_read_answers(path, settings))
        records = [record for index, conversation in enumerate(conversations)
                   for record in _conversation_records(index, conversation, done, tokenizer, None)]
        records = [dataclasses.replace(record, id=i) for i, record in enumerate(records)]
        info = {"settings": settings, "records": len(records),
                "answer_tokens": sum(len(r.greedy.ids) for r in records),
                "note": "the target's greedy answers to --data (flashmm.train.self_corpus)"}
        write_corpus(folder, records, info)
        for path in folder.glob(ANSWERS_GLOB):
            os.remove(path)
    parallel.barrier()  # the corpus is packed
    return records if parallel.is_main else read_corpus(folder)


def _conversation_records(index: int, conversation: list[dict], done: dict, tokenizer, answer):
    """The CorpusRecords (id 0) of one conversation's answered user turns, in order: each answer from
    ``done`` (key "index:turn"), or, missing there, from ``answer(key, prompt_ids)`` (None: every answer
    must be there). A later turn's prompt holds the earlier answers."""
    every_turn = all(m["role"] == "user" for m in conversation)  # "turns": each answered in order
    messages = []
    for turn, message in enumerate(conversation):
        messages.append(message)
        if not (turn + 1 == len(conversation) or (every_turn and message["role"] == "user")):
            continue
        key = f"{index}:{turn}"
        row = done.get(key)
        if row is None:
            if answer is None:
                raise RuntimeError(f"corpus: no answer to conversation {index + 1}, turn {turn + 1} in any answers "
                                   "file after every process finished")
            row = answer(key, render(tokenizer, messages, f"--data conversation {index + 1}"))
        text = tokenizer.decode(row["ids"])
        yield CorpusRecord(id=0, prompt=message["content"], prompt_ids=row["prompt_ids"],
                           greedy=Answer(text, row["ids"], row["finished"]))
        messages.append({"role": "assistant", "content": text})


def _read_answers(path: Path, settings: dict, repair: bool = True) -> dict[str, dict]:
    """The answers an interrupted build wrote (a torn last line is dropped, and with ``repair`` the file
    rewritten without it)."""
    if not path.is_file():
        return {}
    lines = path.read_text().splitlines()
    if not lines:
        return {}
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError:
        header = {}  # a kill while the header was written: nothing answered yet
        lines = []
    if lines and header.get("settings") != settings:
        raise ValueError(f"{path} was written for other prompts or settings; use another --out, or delete "
                         f"{path.parent} to rebuild it")
    done = {}
    for line in lines[1:]:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break  # the line a killed run was writing
        done[row["key"]] = row
    if repair:
        path.write_text("".join(line + "\n" for line in lines[:1 + len(done)]))
    return done

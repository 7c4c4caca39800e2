// codecomplete for VS Code: starts codecomplete-daemon for the workspace folder and
// gets inline completions through vscode-languageclient's LSP 3.18 inline-completion
// support. The status bar shows the daemon's state and the last completion's latency;
// shown, accepted and rejected completions are reported to the daemon.
import * as vscode from 'vscode';
import {
  LanguageClient,
  LanguageClientOptions,
  ServerOptions,
  TransportKind,
} from 'vscode-languageclient/node';

let client: LanguageClient | undefined;
let status: vscode.StatusBarItem;
let output: vscode.LogOutputChannel;
let poller: NodeJS.Timeout | undefined;
let lastShown: string | undefined; // completion id shown and not yet accepted
let lastLatencyMs: number | undefined;
let cursorTimer: NodeJS.Timeout | undefined;
let lastCursor: { uri?: string; line?: number } = {}; // where didMoveCursor last said the cursor rests
let lastEdit: { uri: string; at: number } | undefined; // the user's last edit in the active editor

interface DaemonStats {
  counters?: { latency_ms?: { p50?: number } };
  engine?: { ready?: boolean; load_error?: string | null; model?: string };
  index?: { state?: string };
}

/** The settings the daemon understands, in the shape of its config file. */
export function daemonSettings(): Record<string, unknown> {
  const c = vscode.workspace.getConfiguration('codecomplete');
  return {
    model: c.get('model') ?? {}, completion: c.get('completion') ?? {}, index: c.get('index') ?? {},
    speculation: c.get('speculation') ?? {},
  };
}

function serverOptions(): ServerOptions {
  const c = vscode.workspace.getConfiguration('codecomplete');
  const folder = vscode.workspace.workspaceFolders?.[0]?.uri.fsPath;
  const args = [...(folder ? ['--repo', folder] : []), ...(c.get<string[]>('server.args') ?? [])];
  return {
    command: c.get<string>('server.path') || 'codecomplete-daemon',
    args,
    options: folder ? { cwd: folder } : undefined,
    transport: TransportKind.stdio,
  };
}

function completionIdOf(item: vscode.InlineCompletionItem): string | undefined {
  const arg = item.command?.arguments?.[0] as { completionId?: string } | undefined;
  return arg?.completionId;
}

function setStatus(text: string, tooltip?: string): void {
  status.text = text;
  status.tooltip = tooltip ?? 'codecomplete: click for statistics';
  status.show();
}

function clientOptions(): LanguageClientOptions {
  return {
    // notebook cells: asked at as cells; the client syncs their notebooks as notebooks (the server
    // offers notebookDocumentSync), so a cell completes with the code cells around it
    documentSelector: [{ scheme: 'file' }, { scheme: 'untitled' }, { scheme: 'vscode-notebook-cell' }],
    initializationOptions: { codecomplete: daemonSettings() },
    outputChannel: output,
    middleware: {
      provideInlineCompletionItems: async (document, position, context, token, next) => {
        const started = Date.now();
        const result = await next(document, position, context, token);
        const items = Array.isArray(result) ? result : result?.items ?? [];
        if (lastShown && client) {
          // A new request while the previous completion is still unaccepted: it was passed over.
          void client.sendNotification('codecomplete/didRejectCompletion', { completionId: lastShown });
          lastShown = undefined;
        }
        const id = items[0] ? completionIdOf(items[0]) : undefined;
        if (id && client && !token.isCancellationRequested) {
          lastLatencyMs = Date.now() - started;
          lastShown = id;
          void client.sendNotification('codecomplete/didShowCompletion', { completionId: id });
          setStatus(`$(sparkle) codecomplete ${lastLatencyMs} ms`);
        }
        return result;
      },
      executeCommand: async (command, args, next) => {
        if (command === 'codecomplete.accept') {
          lastShown = undefined; // accepted: not a rejection
        }
        return next(command, args);
      },
    },
  };
}

async function pollStatus(): Promise<void> {
  if (!client || !client.isRunning()) {
    return;
  }
  try {
    const stats = await client.sendRequest<DaemonStats>('codecomplete/stats', {});
    const engine = stats.engine ?? {};
    if (engine.load_error) {
      setStatus('$(error) codecomplete: model unavailable', engine.load_error);
    } else if (stats.index?.state === 'indexing') {
      setStatus('$(sync~spin) codecomplete: indexing');
    } else if (!engine.ready) {
      setStatus('$(loading~spin) codecomplete: loading model');
    } else if (lastLatencyMs === undefined) {
      setStatus('$(sparkle) codecomplete: ready', `model ${engine.model ?? '?'}`);
    }
  } catch (err) {
    output.appendLine(`stats request failed: ${String(err)}`);
  }
}

async function start(context: vscode.ExtensionContext): Promise<void> {
  setStatus('$(loading~spin) codecomplete: starting');
  client = new LanguageClient('codecomplete', 'codecomplete', serverOptions(), clientOptions());
  try {
    await client.start();
  } catch (err) {
    setStatus('$(error) codecomplete: daemon failed to start', String(err));
    void vscode.window.showErrorMessage(
      `codecomplete: could not start the daemon (${String(err)}). Check codecomplete.server.path.`);
    return;
  }
  // Keys typed while the daemon started found no inline provider (the client registers it when
  // the daemon answers initialize), and VS Code asks again only at the next key: ask now where the
  // user was typing a moment ago. The request waits for the model if it is still loading.
  const editor = vscode.window.activeTextEditor;
  if (editor && lastEdit && lastEdit.uri === editor.document.uri.toString() && Date.now() - lastEdit.at < 5000) {
    void vscode.commands.executeCommand('editor.action.inlineSuggest.trigger');
  } else {
    // where the cursor rests as the daemon starts (no selection change tells it until the user
    // moves): the daemon prefills the prompt there while the model loads; after the same pause
    // as a motion's, so the client's didOpen for that document has gone first (the daemon
    // ignores a cursor in a document it does not have)
    lastCursor = {};
    cursorTimer = setTimeout(() => tellCursor(editor), 150);
  }
  await pollStatus();
  poller = setInterval(() => void pollStatus(), 2000);
  context.subscriptions.push({ dispose: () => poller && clearInterval(poller) });
}

/** codecomplete/didMoveCursor for `editor`'s cursor, where it is the active editor and the
 * cursor is on another line than last said. */
function tellCursor(editor: vscode.TextEditor | undefined): void {
  if (!editor || !client || !client.isRunning() || vscode.window.activeTextEditor !== editor) {
    return;
  }
  const pos = editor.selection.active;
  const uri = client.code2ProtocolConverter.asUri(editor.document.uri);
  if (uri === lastCursor.uri && pos.line === lastCursor.line) {
    return;
  }
  lastCursor = { uri, line: pos.line };
  void client.sendNotification('codecomplete/didMoveCursor', {
    textDocument: { uri },
    position: { line: pos.line, character: pos.character },
  });
}

async function stop(): Promise<void> {
  if (poller) {
    clearInterval(poller);
    poller = undefined;
  }
  if (client) {
    await client.stop();
    client = undefined;
  }
}

export async function activate(context: vscode.ExtensionContext): Promise<void> {
  output = vscode.window.createOutputChannel('codecomplete', { log: true });
  status = vscode.window.createStatusBarItem(vscode.StatusBarAlignment.Right, 100);
  status.command = 'codecomplete.showStats';
  context.subscriptions.push(output, status);

  context.subscriptions.push(
    vscode.commands.registerCommand('codecomplete.restart', async () => {
      await stop();
      await start(context);
    }),
    vscode.commands.registerCommand('codecomplete.showStats', async () => {
      if (!client) {
        return;
      }
      const stats = await client.sendRequest('codecomplete/stats', { config: true });
      output.appendLine(JSON.stringify(stats, null, 2));
      output.show(true);
    }),
    vscode.commands.registerCommand('codecomplete.acceptNextWord', () =>
      vscode.commands.executeCommand('editor.action.inlineSuggest.acceptNextWord')),
    vscode.commands.registerCommand('codecomplete.acceptNextLine', () =>
      vscode.commands.executeCommand('editor.action.inlineSuggest.acceptNextLine')),
    // Where the cursor rests (150 ms after it last moved, on another line than last time): the
    // daemon prefills the prompt there, so the first keystroke's completion after navigating
    // does not wait for a cold prompt (codecomplete.completion.warmMs, 0: it ignores these).
    vscode.window.onDidChangeTextEditorSelection((e) => {
      if (cursorTimer) {
        clearTimeout(cursorTimer);
      }
      cursorTimer = setTimeout(() => tellCursor(e.textEditor), 150);
    }),
    // another editor (a tab switched to, a file opened): no selection change fires for it
    vscode.window.onDidChangeActiveTextEditor((editor) => {
      if (cursorTimer) {
        clearTimeout(cursorTimer);
      }
      cursorTimer = setTimeout(() => tellCursor(editor), 150);
    }),
    vscode.workspace.onDidChangeTextDocument((e) => {
      if (e.contentChanges.length && e.document === vscode.window.activeTextEditor?.document) {
        lastEdit = { uri: e.document.uri.toString(), at: Date.now() };
      }
    }),
    vscode.workspace.onDidChangeConfiguration(async (e) => {
      if (e.affectsConfiguration('codecomplete.server')) {
        await stop();
        await start(context);
      } else if (e.affectsConfiguration('codecomplete') && client) {
        await client.sendNotification('workspace/didChangeConfiguration', {
          settings: { codecomplete: daemonSettings() },
        });
        lastLatencyMs = undefined;
        await pollStatus();
      }
    }),
  );
  await start(context);
}

export async function deactivate(): Promise<void> {
  await stop();
}
